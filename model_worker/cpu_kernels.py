"""Fused float32 CPU kernels (`csrc/cpu_kernels.cpp`) as `torch.ops.radixserve.*`, built once per machine.

The decode step of a small model on 2 cores spent a third of its time outside its linears: ~600 small torch ops a
step (norms, residual sums, SiLU, K/V gathers, SDPA's setup), each paying dispatch and the cache misses left by a
linear that streamed megabytes of weights. The kernels do that work in fewer passes:

- `rms_norm(x, weight, eps)` and `add_rms_norm_(x, residual, weight, eps)` (residual += x; x = norm(residual)),
- `rope_(qkv, cos, sin, positions, rotated)`: RoPE in place on the q and k heads of the fused projection's output,
  bit for bit torch's ops,
- `paged_attention(q, k_cache, v_cache, block_tables, starts, lengths, scale)`: causal attention of chunks of new
  tokens (prefill parts and decode rows alike) over their sequences' pages, read in place: no gather, no mask, one
  read of each K/V page per group of query heads (GQA) and up to 32 positions; head_dim 64 or 128,
- `pack_linear_weight(weight)` once at load, then `linear(x, packed, n, bias)`: the model's linear layers, one FMA
  chain per output at every row count; a decode step's few rows stream the weights at memory speed;
  `pack_gate_up_weight` and `gate_up_silu(x, packed, intermediate, bias)`: the MLP's gate/up projection with SiLU of
  the gate times the up applied to each tile in registers,
- `decoder_layer(...)`: a whole Llama layer (the ops above, and the new K/V written into the pool) in one call, bit
  for bit the layer-by-layer result (`model_worker.model.DecoderLayer.fused_forward`): a 4-sequence decode step
  took 27-28 instead of 30-33 ms.

Each computes a row alone, in the same order whatever the batch, so K/V and outputs do not depend on the batch
(caching never changes output); they round differently from torch's kernels (~1e-6 relative).

`load()` compiles the source for x86-64-v3 (AVX2 and FMA) with torch's C++ extension builder (g++ and ninja, ~15 s
on 2 cores) into `$RADIXSERVE_CACHE/kernels/<digest>/`, keyed by the source, torch's version and the flags, and
loads it; later processes load the built library. `make install` and the Docker image build it ahead
(`python -m model_worker.cpu_kernels`). On a CPU without AVX2 and FMA, or where it cannot be built or loaded,
`load()` logs why and returns False, and the model runs on torch's ops.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path

import torch

from radixserve.config import cache_root

log = logging.getLogger("model_worker.cpu_kernels")

SOURCE = Path(__file__).resolve().parent / "csrc" / "cpu_kernels.cpp"
NAME = "radixserve_cpu_kernels"
FLAGS = ["-O3", "-march=x86-64-v3", "-ffp-contract=off", "-fopenmp"]  # only the FMAs the source spells
REQUIRED_CPU_FLAGS = ("avx2", "fma")


def build_directory() -> Path:
    digest = hashlib.sha256("|".join([SOURCE.read_text(), torch.__version__, " ".join(FLAGS)]).encode())
    return cache_root() / "kernels" / digest.hexdigest()[:16]


def _missing_cpu_flags() -> list[str]:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return list(REQUIRED_CPU_FLAGS)
    return [flag for flag in REQUIRED_CPU_FLAGS if flag not in flags]


@functools.cache
def load() -> bool:
    """Loads the kernels, building them first where this machine has not (concurrent builders wait on the
    builder's lock); whether `torch.ops.radixserve` has them now."""
    from torch.utils.cpp_extension import load as build_and_load

    if missing := _missing_cpu_flags():
        log.warning("fused CPU kernels unavailable; using torch ops", extra={"reason": f"no {', '.join(missing)}"})
        return False
    try:
        directory = build_directory()
        library = directory / f"{NAME}.so"
        if library.exists():
            torch.ops.load_library(str(library))
        else:
            directory.mkdir(parents=True, exist_ok=True)
            build_and_load(name=NAME, sources=[str(SOURCE)], extra_cflags=FLAGS, extra_ldflags=["-fopenmp"],
                           build_directory=str(directory), is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no ninja, a failed build or load: the model runs on torch's ops
        reason = f"{type(exc).__name__}: {exc}"[:500]
        log.warning("fused CPU kernels unavailable; using torch ops", extra={"reason": reason})
        return False
    return True


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    if not load():
        raise SystemExit("the fused CPU kernels did not build here; the worker will run on torch's ops")
    print(f"fused CPU kernels ready in {build_directory()}")
