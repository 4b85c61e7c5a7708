"""Grouped matmuls of dropless MoE layers (nestor.backend.mosaic_gpu, models.ops.ragged_dot): each implementation's error against a
per-group reference and its time, forward and backward, on the first local device.

The problem is one expert layer's gate projection on one device: `--rows` rows
[rows, embed] sorted by expert into `--experts` groups of uneven sizes (one
empty, a tenth of the rows past the last group, as a dropless layer's buffer
has), times [experts, embed, width] weights, in bfloat16 (float32 on CPU).
Each implementation is checked against the reference (per group, one dense
float32-sum product masked to the group's rows, in the compute dtype): the
forward output, the rows past the groups (must be zeros), and the gradients
of a loss linear in the output (d_rows and d_weights; jax then skips the
forward). Then each is timed, jit-compiled, over `--repeats` calls: the
forward, and the backward (the two gradient matmuls). TFLOP/s counts the
rows in groups only (2 x rows x embed x width per matmul).

    python -m bench.grouped                     # every implementation this device runs
    python -m bench.grouped --rows 8192 --embed 512 --width 1024 --experts 8 --repeats 5

`mosaic_gpu` (jax's Pallas grouped-GEMM kernels) runs on Hopper GPUs only;
elsewhere the table has `xla` (`jax.lax.ragged_dot`) alone.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from nestor.backend import is_hopper, platform_family
from nestor.backend.mosaic_gpu import IMPLEMENTATIONS, grouped_matmul_op

ALONE = tuple(name for name in IMPLEMENTATIONS if name != "mosaic_gpu_or_xla")  # each of them on its own


def group_sizes(rows: int, experts: int, seed: int = 0) -> np.ndarray:
    """Returns [experts] uneven group sizes adding up to 90% of `rows`, expert 1's group empty."""
    shares = np.random.default_rng(seed).uniform(0.5, 1.5, experts)
    shares[1] = 0.0
    return np.floor(shares / shares.sum() * 0.9 * rows).astype(np.int32)


def reference(rows: jax.Array, weights: jax.Array, sizes: jax.Array) -> jax.Array:
    """Returns the grouped product as one dense matmul per group, masked to the group's rows."""
    ends = jnp.cumsum(sizes)
    group = jnp.searchsorted(ends, jnp.arange(rows.shape[0]), side="right")  # experts past the last group
    output = jnp.zeros((rows.shape[0], weights.shape[2]), jnp.float32)
    for expert in range(weights.shape[0]):
        product = jnp.dot(rows, weights[expert], preferred_element_type=jnp.float32)
        output = output + jnp.where((group == expert)[:, None], product, 0.0)
    return output.astype(rows.dtype)


def runs_here(implementation: str, device) -> bool:
    """True when `device` runs `implementation`: mosaic_gpu needs a Hopper GPU."""
    return implementation != "mosaic_gpu" or (platform_family(device.platform) == "gpu" and is_hopper(
        device.device_kind, getattr(device, "compute_capability", None)))


def timed(function, *args, repeats: int) -> float:
    """Returns the mean milliseconds of `repeats` calls of jit(function) after one to compile."""
    compiled = jax.jit(function)
    jax.block_until_ready(compiled(*args))
    started = time.perf_counter()
    for _ in range(repeats):
        result = compiled(*args)
    jax.block_until_ready(result)
    return (time.perf_counter() - started) / repeats * 1e3


def measure(name: str, product, rows: jax.Array, weights: jax.Array, sizes: jax.Array, repeats: int) -> dict:
    """Returns row `name`: the errors against `reference` and the times of `product(rows, weights, sizes)`."""
    cotangent = jax.random.normal(jax.random.key(2), (rows.shape[0], weights.shape[2])).astype(rows.dtype)

    def gradients(of):
        """Returns jit(d loss / d (rows, weights)) of the matmul `of`, the loss linear in its output."""
        loss = lambda r, w: jnp.sum(of(r, w, sizes).astype(jnp.float32) * cotangent.astype(jnp.float32))  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1)))

    as_float = lambda x: np.asarray(x, np.float32)  # noqa: E731
    output, want = as_float(jax.jit(product)(rows, weights, sizes)), as_float(jax.jit(reference)(rows, weights, sizes))
    got_grads, want_grads = gradients(product)(rows, weights), gradients(reference)(rows, weights)
    end = int(np.sum(np.asarray(sizes)))
    flops = 2 * end * rows.shape[1] * weights.shape[2]
    forward = timed(product, rows, weights, sizes, repeats=repeats)
    backward = timed(gradients(product), rows, weights, repeats=repeats)
    relative = lambda a, b: float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))  # noqa: E731
    return {"implementation": name, "forward_error": relative(output, want),
            "d_rows_error": relative(as_float(got_grads[0]), as_float(want_grads[0])),
            "d_weights_error": relative(as_float(got_grads[1]), as_float(want_grads[1])),
            "past_groups_zero": bool(np.all(output[end:] == 0.0)), "finite": bool(np.all(np.isfinite(output))),
            "forward_ms": forward, "forward_tflops": flops / forward / 1e9,
            "backward_ms": backward, "backward_tflops": 2 * flops / backward / 1e9}


def table(results: list[dict]) -> str:
    """Returns the rows as a markdown table."""
    lines = ["| implementation | forward error | d_rows error | d_weights error | rows past groups zero | "
             "forward ms | forward TFLOP/s | backward ms | backward TFLOP/s |", "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['implementation']} | {r['forward_error']:.2g} | {r['d_rows_error']:.2g} | "
                     f"{r['d_weights_error']:.2g} | {r['past_groups_zero'] and r['finite']} | {r['forward_ms']:.2f} | "
                     f"{r['forward_tflops']:.3g} | {r['backward_ms']:.2f} | {r['backward_tflops']:.3g} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    """Parses the command line, measures each implementation this device runs and the reference, prints
    the table and returns its rows."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=65536, help="rows of the sorted buffer")
    parser.add_argument("--embed", type=int, default=1024, help="K: each row's width (multiple of 128)")
    parser.add_argument("--width", type=int, default=2048, help="N: the expert width (multiple of 128)")
    parser.add_argument("--experts", type=int, default=8, help="G: groups")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per measurement")
    args = parser.parse_args(argv)
    device = jax.devices()[0]
    dtype = jnp.float32 if device.platform == "cpu" else jnp.bfloat16
    rows = jax.random.normal(jax.random.key(0), (args.rows, args.embed)).astype(dtype)
    weights = (jax.random.normal(jax.random.key(1), (args.experts, args.embed, args.width))
               / np.sqrt(args.embed)).astype(dtype)
    sizes = jnp.asarray(group_sizes(args.rows, args.experts))
    print(f"{device.device_kind} ({device.platform}), jax {jax.__version__}, {jnp.dtype(dtype).name}: "
          f"rows {args.rows} ({int(sizes.sum())} in groups), embed {args.embed}, width {args.width}, "
          f"{args.experts} experts")
    products = {name: grouped_matmul_op(name) for name in ALONE if runs_here(name, device)}
    results = [measure(name, product, rows, weights, sizes, args.repeats)
               for name, product in {**products, "reference": reference}.items()]
    print(table(results))
    return results


if __name__ == "__main__":
    main()
