"""One prepared check of the stack on a lent CUDA GPU (H100 / H200), runnable with no network:

    python -m prefixcache_bench.gpu_check OUTDIR [--deadline-s 450] [--dry-run]

Stages, each with its own time budget inside one overall deadline, each written to
OUTDIR/stage_<name>.json as soon as it ends (and the whole run to OUTDIR/gpu_check.json after
every stage), so a run cut short still returns what it did:

- `tests`   (stage_tests.py): the GPU-marked pytest tests, then the other kernel tests on CUDA
  (fp16/fp32 Triton against the references), junit parsed into the JSON;
- `kernels` (stage_kernels.py): paged decode attention (HBM GB/s over peak), extend/prefill
  attention (TFLOP/s over dense bf16 peak), Mamba2 chunk scan and state update, LoRA, each
  checked against its reference, PyTorch's scaled_dot_product_attention beside attention;
- `engine`  (stage_engine.py): the engine on a random-weight Llama-3-8B-shaped model in bf16
  (decode tok/s at batch 1/32/128, TTFT of a 4k prompt cold vs 90% cached, prefix caching at 0%
  hits vs none) and transformers' `generate` on the same weights; a SmolLM2-135M-shaped model;
- `sizing`  (stage_sizing.py): --kv-memory-fraction on the real device.

`--dry-run` runs every stage's code on CPU with tiny shapes (Triton interpreted); the test suite
runs it (tests/prefixcache_bench/test_gpu_check.py). Exit status: 1 when a correctness check
failed, 2 when no check failed but a stage raised, 0 otherwise. docs/gpu.md says how to run it
on a lent device.
"""
