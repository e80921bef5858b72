"""The kernels stage's shapes and tolerances: Llama-3-8B's attention, Bamba-9B's Mamba2 mixer, a
4096 x 4096 LoRA projection on a GPU; tiny ones for --dry-run (the CPU interpreter)."""
from __future__ import annotations

import torch

HQ, HKV, HEAD_DIM = 32, 8, 128  # Llama-3-8B
PAGE = 16
L2_ROTATE_BYTES = 256 << 20  # rotate input sets until this much is touched (L2 is 50-60 MB)
MAX_KV_BYTES = 6 << 30
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}


def _tol(dtype: torch.dtype, dry_run: bool) -> float:
    return TOL[dtype] if not dry_run else max(TOL[dtype], 1e-4)


class Shapes:
    def __init__(self, dry_run: bool):
        if dry_run:
            self.dtype = torch.float32  # the interpreter's bf16 dot is emulated and slow
            self.heads = (4, 2, 32)
            self.decode = [(1, 64), (4, 96)]
            self.extend = [(1, 64)]
            self.sweep = (1, 64)
            self.sweep_configs = [(32, 32, 4, 1)]  # + the default: two interpreted runs
            self.mamba = dict(H=4, P=16, N=16, G=1, chunk=16, seqs=[(1, 40)], ref_tokens=40)
            self.state_batches = [2]
            self.lora = dict(d_in=64, d_out=64, rank=16, slots=2, tokens=[8])
            self.warmup, self.reps = 1, 2
        else:
            self.dtype = torch.bfloat16
            self.heads = (HQ, HKV, HEAD_DIM)
            self.decode = [(b, n) for n in (1024, 4096, 16384) for b in (1, 16, 64, 128)]
            self.extend = [(1, 2048), (4, 4096), (1, 16384)]
            self.sweep = (4, 4096)
            # Around the table's default for sm90 (64, 64, 4, 4: first in runs 4-6's sweeps;
            # 64, 64, 4, 3 before it, the best of the first two, 1.14x and 1.24x over the
            # 128-row tiles).
            self.sweep_configs = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
                                  (64, 128, 4, 3), (64, 64, 4, 4), (64, 64, 8, 3),
                                  (64, 32, 4, 3), (128, 64, 4, 3)]
            self.mamba = dict(H=128, P=64, N=128, G=1, chunk=256,
                              seqs=[(4, 2048), (1, 16384)], ref_tokens=512)
            self.state_batches = [1, 32, 128]
            self.lora = dict(d_in=4096, d_out=4096, rank=16, slots=4, tokens=[16, 256, 4096])
            self.warmup, self.reps = 3, 20
