"""The configuration of a comparison, assembled from flags and frozen, holding parsed policies;
and the fp32 pre-training of certify/advise, against a plain torch loop."""

import dataclasses

import pytest
import torch
from torch import nn

from lowprec.experiments.assembly import assemble_config
from lowprec.experiments.config import PRESETS, CompareConfig, RunError
from lowprec.experiments.pretrain import train_fp32, untrained
from lowprec.training.policy import Policy, parse_policy


def test_the_config_is_frozen_and_holds_parsed_policies_named_as_given():
    spec = "p=fp32,c=bf16,g=bf16,s=matmul"
    cfg = CompareConfig(policies=f"32-true,{spec},e4m3fn", seeds=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.epochs = 3
    assert all(isinstance(p, Policy) for p in cfg.policies)
    assert cfg.policies[1] == parse_policy(spec) and str(cfg.policies[1]) == spec
    assert cfg.seeds == (0, 1)
    cfg.validate()
    assert cfg.to_json()["policies"] == ["32-true", spec, "e4m3fn"]
    # rebuilt from its own fields (as a multi-model comparison does per model): the same
    again = dataclasses.replace(cfg, model="mlp")
    assert again.policies == cfg.policies and again.to_json()["policies"] == cfg.to_json()["policies"]


def test_a_bad_policy_is_reported_by_validate_as_before():
    cfg = CompareConfig(policies=("32-true", "17-true"))
    with pytest.raises(RunError, match="unknown policy '17-true'"):
        cfg.validate()
    with pytest.raises(RunError, match="listed twice"):
        CompareConfig(policies=("16-true", "16-true")).validate()
    # the same policy under two names is two runs, as before (names key the runs)
    CompareConfig(policies=("16-true", "p=fp16,c=fp16,g=fp16,o=fp16")).validate()


def test_threads_resolve_into_a_new_config():
    cfg = CompareConfig()
    done = cfg.resolve_threads({"threads": 3})
    assert cfg.threads is None and done.threads == 3
    assert done.resolve_threads({"threads": 5}) is done


def test_flags_override_the_preset_and_an_unknown_preset_is_refused(tmp_path):
    cfg = assemble_config(out=str(tmp_path / "r"), preset="gupta", epochs=2, lr=None,
                          seeds=1)
    assert [str(p) for p in cfg.policies] == list(PRESETS["gupta"]["policies"])
    assert cfg.epochs == 2 and cfg.lr == CompareConfig().lr and cfg.seeds == (0,)
    cfg = assemble_config(out="x", policies="32-true,p=fp16,c=fp16", overrides={"seeds": (4,)})
    assert [str(p) for p in cfg.policies] == ["32-true", "p=fp16,c=fp16"] and cfg.seeds == (4,)
    with pytest.raises(ValueError, match="preset='nope'; accepted: default"):
        assemble_config(out="x", preset="nope")


def test_train_fp32_is_a_plain_sgd_loop():
    model, data = untrained("digits", "mlp", seed=3)
    twin, _ = untrained("digits", "mlp", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    seen = []
    train_fp32(model, data, epochs=1, lr=0.05, batch_size=64, seed=3, on_epoch=seen.append)
    assert seen == [1]
    # the same epoch written out with torch alone
    opt = torch.optim.SGD(twin.parameters(), lr=0.05, momentum=0.9)
    n = len(data.x_train)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(3 * 1000))
    for i in range(0, n, 64):
        idx = perm[i:i + 64]
        opt.zero_grad()
        nn.functional.cross_entropy(twin(data.x_train[idx]), data.y_train[idx]).backward()
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
