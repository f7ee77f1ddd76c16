"""Repeated transformer blocks run by one ``jax.lax.scan`` over layer-stacked weights.

Why: the compiler's input. SDXL's UNet has 70 ``BasicTransformerBlock``s, 60 of them in stages of
10 identical blocks; unrolled, XLA compiles every copy (184 s for SDXL's serving program on a TPU
v5e). A scan traces, lowers and compiles one block per stage, whatever the stage's depth.

How the weights get there, once, at load time::

    checkpoint --fill--> unstacked State   transformer_blocks.0.attn1.to_q.kernel  (in, out)
                                           transformer_blocks.1.attn1.to_q.kernel  (in, out) ...
               --stack--> stacked State    transformer_blocks.stacked.attn1.to_q.kernel  (N, in, out)

The loaders, the checkpoint keys and the fp8/GGUF placement are unchanged: ``fill`` fills the
model built unstacked, and ``stack`` moves each stage's N leaves into one (N, ...) leaf of the
model built stacked (a ``BlockStack`` under the same attribute), after the reads when those are
deferred. The per-block Variables are emptied as their stage is stacked, so a load holds about one
stage twice, never the model. ``unstack`` goes back (saving, comparing with a checkpoint).

Inside the traced call a ``BlockStack`` slices its block's weights along the layer axis per
iteration: the fp8/quantised upcast (``storage.upcast``, which skips stacked leaves) and the LoRA
factors of that block (``adapters.attach`` hands them stacked) ride with the slice.

Only stages of ``scan_min()`` blocks or more are stacked (``PREHEAT_SCAN_MIN``, default 3;
``off`` stacks none). Why not 2: SDXL's 2-block stages are 10 of its 70 blocks; scanning them
would save 5 block bodies of compile while giving up XLA's fusion across the two blocks for a
two-trip loop, a trade not worth its risk to the steady state.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from preheat.errors import InvalidArgumentError
from preheat.models.block_paths import RUN, STACKED, block_path, is_stacked_path

__all__ = ["SCAN_MIN", "scan_min", "scanned", "BlockStack", "blocks", "block_runs", "run_blocks", "stack", "unstack"]

Array = jax.Array

SCAN_MIN = 3
_ENV = "PREHEAT_SCAN_MIN"


def scan_min() -> int | None:
    """The fewest blocks a stage needs to be scanned (``PREHEAT_SCAN_MIN``), or None: never."""
    raw = os.environ.get(_ENV, "").strip().lower()
    if not raw:
        return SCAN_MIN
    if raw in ("off", "none", "0"):
        return None
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgumentError(f"{_ENV} must be a block count (>= 2) or 'off', got {raw!r}") from None
    if value < 2:
        raise InvalidArgumentError(f"{_ENV} must be a block count (>= 2) or 'off', got {raw!r}")
    return value


def scanned(layers: int) -> bool:
    """Whether a stage of ``layers`` identical blocks runs as a scan."""
    least = scan_min()
    return least is not None and layers >= least


class BlockStack(nnx.Module):
    """N blocks of one kind as one block whose parameters carry a leading (N,) layer axis.

    ``make()`` builds one block; in an abstract build (``weights.build_abstract``) only shapes are
    made, otherwise N blocks are initialised and their weights stacked (training, tests)."""

    def __init__(self, make: Callable[[], nnx.Module], n: int):
        first = make()
        graphdef, state = nnx.split(first)
        leaves = jax.tree.leaves(state)
        if leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
            state = jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype), state)
        else:
            states = [state] + [nnx.split(make())[1] for _ in range(n - 1)]
            state = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
        self.stacked = nnx.merge(graphdef, state)
        self.n = n

    def __call__(self, x: Array, *args: Any) -> Array:
        """``x`` through the N blocks in order: ``block_i(x, *args)``, one scan iteration each."""
        return self.run(x, lambda block, h: block(h, *args))

    def run(self, carry: Any, step: Callable[[nnx.Module, Any], Any], skip: Sequence[int] = (),
            emit: bool = False) -> Any:
        """``carry`` (a pytree, e.g. Flux's (text, image) streams) through the N blocks in order:
        ``carry = step(block_i, carry)``. Each block's weights are upcast (fp8, quantised) to the
        carry's dtype inside its iteration, tied to the carry, as ``LoadedX.apply`` does.
        ``skip``: block indices (0..N-1, static) passed over (SD3.5's skip-layer guidance): a
        ``lax.cond`` per iteration, in the programs that skip only.
        ``emit``: also every block's output, stacked (N, ...) -- ``(carry, outputs)`` -- for the
        callers that keep each layer's state (CLIP's ``hidden_states``, read by clip_skip)."""
        from preheat.models.storage import upcast

        graphdef, state = nnx.split(self.stacked)  # every leaf (N, ...)
        lora = getattr(self, "lora", None)  # per-layer adapters (adapters.attach), each factor (N, K, ...)
        factors = {} if lora is None else lora.factors
        skipped = jnp.asarray([i in skip for i in range(self.n)]) if skip else None  # (N,) bool

        def body(c: Any, xs: Any) -> tuple[Any, Any]:
            layer, layer_factors, off = xs

            def one(c: Any) -> Any:
                dtype = jax.tree.leaves(c)[0].dtype
                block = nnx.merge(graphdef, upcast(layer, dtype, tie=c))  # one block's weights, fp8 upcast here
                if lora is not None:
                    lora.attach_stacked(block, layer_factors)
                return step(block, c)

            c = one(c) if off is None else jax.lax.cond(off, lambda c: c, one, c)
            return c, (c if emit else None)

        out, ys = jax.lax.scan(body, carry, (state, factors, skipped))
        return (out, ys) if emit else out


def blocks(make: Callable[[], nnx.Module], n: int, stacked: bool) -> nnx.Module:
    """A stage of ``n`` blocks: one ``BlockStack`` when ``stacked`` and deep enough, else an ``nnx.List``."""
    if stacked and scanned(n):
        return BlockStack(make, n)
    return nnx.List([make() for _ in range(n)])


def block_runs(make: Callable[[int], nnx.Module], kinds: Sequence[Hashable], stacked: bool) -> nnx.Module:
    """A stage whose blocks are not all alike (SD3: the last block differs, SD3.5 medium's first
    13 add a second attention): block ``i`` is ``make(i)``, of kind ``kinds[i]``. Stacked, each
    run of like blocks deep enough is one ``BlockStack`` keyed ``"a:b"`` and every other block
    keeps its index as its key (``nnx.Dict``), so both map to the checkpoint's ``X.<i>`` paths."""
    n = len(kinds)
    starts = [i for i in range(n) if i == 0 or kinds[i] != kinds[i - 1]]
    spans = [(a, b) for a, b in zip(starts, [*starts[1:], n])]
    if not stacked or not any(scanned(b - a) for a, b in spans):
        return nnx.List([make(i) for i in range(n)])
    out: dict[str, nnx.Module] = {}
    for a, b in spans:
        if scanned(b - a):
            out[f"{a}:{b}"] = BlockStack(lambda a=a: make(a), b - a)
        else:
            out.update({str(i): make(i) for i in range(a, b)})
    return nnx.Dict(out)


def run_blocks(stage: nnx.Module, carry: Any, step: Callable[[nnx.Module, Any], Any], skip: Sequence[int] = ()) -> Any:
    """``carry = step(block, carry)`` for each block of a stage (``blocks``, ``block_runs``), in
    order: a scan or a Python loop. ``skip``: block indices (static) passed over."""
    if isinstance(stage, BlockStack):
        return stage.run(carry, step, skip)
    items = stage.items() if isinstance(stage, nnx.Dict) else enumerate(stage)
    for key, block in items:
        run = RUN.match(str(key))
        if isinstance(block, BlockStack):
            a = int(run.group(1)) if run else 0
            carry = block.run(carry, step, [i - a for i in skip if a <= i < a + block.n])
        elif int(key) not in skip:
            carry = step(block, carry)
    return carry


def _key(path: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(str(p) for p in path)


def stack(make_stacked: Callable[[Any], nnx.Module], params: nnx.State, options: Any = None
          ) -> tuple[nnx.GraphDef, nnx.State]:
    """The stacked model's graph and a State of its weights from the unstacked model's ``params``
    (``fill``'s result, possibly placeholders until ``options.pending`` runs).

    Leaves outside a ``BlockStack`` are the same Variables (no copy); each stacked leaf is
    ``jnp.stack`` of its N per-block leaves, made when the reads are done (``weights.after_reads``),
    its per-block Variables then emptied so the device holds each weight once."""
    from preheat.models.weights import after_reads, build_abstract

    graphdef, abstract = build_abstract(make_stacked)
    flat = {_key(path): var for path, var in nnx.to_flat_state(params)}
    out: list[tuple[tuple[Any, ...], Any]] = []
    groups: list[tuple[Any, list[Any]]] = []  # (stacked Variable, its N per-block Variables)
    for path, var in nnx.to_flat_state(abstract):
        if not is_stacked_path(path):
            out.append((path, flat.pop(_key(path))))
            continue
        at = [i for i, p in enumerate(path) if p == STACKED][0]
        n = var.get_value().shape[0]
        parts = [flat.pop(_key((*block_path(path[:at], i), *path[at + 1:]))) for i in range(n)]
        holder = parts[0].replace(jax.tree.map(lambda x: jax.ShapeDtypeStruct((n, *x.shape), x.dtype),
                                               parts[0].get_value()))
        groups.append((holder, parts))
        out.append((path, holder))
    if flat:
        raise ValueError(f"stacking left parameters without a place: {sorted('.'.join(k) for k in flat)[:3]}")

    def job() -> None:
        for holder, parts in groups:
            holder.set_value(jax.tree.map(lambda *xs: jnp.stack(xs), *[p.get_value() for p in parts]))
            for p in parts:  # the per-block copies go: each weight on the device once
                p.set_value(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), p.get_value()))

    after_reads(job, options)
    return graphdef, nnx.from_flat_state(out)


def unstack(params: nnx.State) -> nnx.State:
    """``stack``'s inverse: each (N, ...) leaf back to its N per-block leaves at their checkpoint
    paths (block indices as ints, as ``nnx.List`` keys them)."""
    def index(p: Any) -> Any:
        return int(p) if isinstance(p, str) and p.isdigit() else p  # block_runs' single blocks: "23" -> 23

    out: list[tuple[tuple[Any, ...], Any]] = []
    for path, var in nnx.to_flat_state(params):
        if not is_stacked_path(path):
            out.append((tuple(index(p) for p in path), var))
            continue
        at = [i for i, p in enumerate(path) if p == STACKED][0]
        value = var.get_value()
        n = jax.tree.leaves(value)[0].shape[0]
        for i in range(n):
            where = tuple(index(p) for p in block_path(path[:at], i))
            out.append(((*where, *path[at + 1:]), var.replace(jax.tree.map(lambda x: x[i], value))))
    return nnx.from_flat_state(out)
