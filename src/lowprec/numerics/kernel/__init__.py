"""ctypes binding of the compiled kernel ``_qkernel`` (built by setup.py at install time from
``numerics/csrc/``), one module per C file:

    library      finding, opening and declaring the library; the C structs (lp_common.h, module.c)
    quantize     elementwise rounding, the batched transpose (quantize.c)
    block        MX block scales and blocked rounding, overflow counts (block.c)
    accumulate   the GEMM with a rounded accumulator, reference-order dot products (accumulate.c)
    optimizer    the fused optimizer step (optimizer.c)
    recurrent    the fused LSTM cell, 16-bit sums of gradients (recurrent.c)
    fexp         ATen's vectorised exp of the 16-bit flash attention, the emulated attention's
                 fused passes over rows of scores (fexp.c)

``available()`` says whether it loaded; ``LOWPREC_KERNEL=0`` in the environment disables it, and
lowprec then uses the plain-torch path, which gives the same bits. Callers use this package's
names (``kernel.quantize_f32``); a test that runs another build of the library replaces
``library.lib``, which every function here calls.
"""

from . import library
from .accumulate import (channel_sums, dot4, gemm_acc, gemm_acc_available, plane_sums, sums,
                         sums_take)
from .block import block_shifts, block_shifts_available, count_abs_ge, quantize_blocks_f32
from .fexp import (attention_rows_available, attn_bwd_ds, attn_bwd_p, attn_fwd_rows,
                   fexp_available, fexp_u20)
from .library import (LPAccFmt, LPAccGemm, LPOpt, LPParams, available, open_kernel, prepare,
                      with_keys)
from .optimizer import opt_dtype_code, opt_step
from .quantize import (nonfinite_available, quantize_f32, quantize_prepared,
                       quantize_prepared_nonfinite, quantize_transposed, transposed_available)
from .recurrent import (affine_round, lstm_available, lstm_backward, lstm_forward, lstm_forward2, lstm_gates,
                        lstm_step, lstm_step_available, index_add_rounded, lstm_op_available,
                        lstm_op_backward, lstm_op_cell, lstm_op_gates, lstm_op_out, round_add2,
                        round_sum_delta, site_params)

__all__ = [
    "library", "available", "open_kernel", "LPParams", "LPOpt", "LPAccFmt", "LPAccGemm", "prepare",
    "with_keys",
    # quantize.c
    "quantize_f32", "quantize_prepared", "quantize_transposed", "transposed_available",
    "nonfinite_available", "quantize_prepared_nonfinite",
    # block.c
    "block_shifts", "block_shifts_available", "quantize_blocks_f32", "count_abs_ge",
    # accumulate.c
    "gemm_acc", "gemm_acc_available", "dot4", "channel_sums", "plane_sums", "sums",
    "sums_take",
    # optimizer.c
    "opt_dtype_code", "opt_step",
    # recurrent.c
    "lstm_available", "lstm_gates", "lstm_forward", "lstm_forward2", "lstm_backward",
    "lstm_step_available", "lstm_step", "round_add2",
    "round_sum_delta", "index_add_rounded", "affine_round", "lstm_op_available", "site_params", "lstm_op_gates",
    "lstm_op_cell", "lstm_op_out", "lstm_op_backward",
    # fexp.c
    "fexp_available", "fexp_u20", "attention_rows_available", "attn_fwd_rows", "attn_bwd_p",
    "attn_bwd_ds",
]
