"""lowprec in the training loops people already have.

* :class:`GradScaler`: ``torch.amp.GradScaler``'s signature and interface (``scale``,
  ``unscale_``, ``step``, ``update``, ``state_dict``, plus ``autocast``) over a lowprec policy
  (``policy=``); unlike torch's, it unscales fp16 gradients, so pure fp16 training with fp16
  parameters runs with the code written for torch.amp.
* :mod:`lowprec.integrations.lightning`: ``LowprecPrecision(policy)``, a Lightning precision
  plugin for ``Trainer(plugins=[...])`` and Fabric, and ``Trainer(precision="p=bf16:kahan")``,
  Lightning's Trainer taking any policy.
* :mod:`lowprec.integrations.huggingface`: ``LowprecTrainer(policy=..., ...)``, the Hugging Face
  ``Trainer`` under a policy.

The Lightning and Hugging Face modules import their frameworks; this package does not, so
``import lowprec`` never needs them (``pip install lowprec[integrations]``).
"""

from .gradscaler import GradScaler

__all__ = ["GradScaler"]
