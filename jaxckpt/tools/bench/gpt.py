"""A small Flax GPT-style language model on a data x model mesh: the training state that examples, tests and
benchmarks snapshot.

Pre-LN decoder blocks (causal self-attention + MLP), token and position embeddings, tied output head, optax
AdamW with warm-up and gradient clipping. Parameters are tensor-parallel on the ``model`` axis (attention heads,
MLP hidden units, vocabulary) and replicated over ``data``; the batch is split over ``data``. The synthetic data
is a noisy permutation chain fixed by the seed: the model can learn it, so the loss falls within a few steps.

Typical use::

    cfg = GPTConfig(d_model=128, layers=4)
    mesh = make_mesh()
    step_fn = make_train_step(cfg, mesh)                # jitted, donates the state
    state = init_state(cfg, mesh, seed=0)
    for step, batch in batches(cfg, mesh, batch_size=16, seed=0):
        state, loss = step_fn(state, batch)
    target = abstract_state(cfg, mesh)                  # ShapeDtypeStructs with the same shardings

The model and optimizer objects are cached per config, so every state built for one config has the same
pytree structure (TrainState keeps ``apply_fn`` and ``tx`` in its treedef) and reuses one compiled step.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

try:  # not dependencies of jaxckpt: only this benchmark model and the examples need them
    import flax.linen as nn
    import optax
    from flax.training import train_state
except ImportError as e:
    raise ImportError(f"the benchmark GPT needs flax and optax ({e}): pip install 'jaxckpt[bench]'") from e

__all__ = ["GPTConfig", "GPT", "TrainState", "make_mesh", "make_model", "make_optimizer", "state_shardings",
           "init_state", "abstract_state", "make_train_step", "batch_at", "device_batch", "batches", "batch_sharding",
           "state_bytes", "param_count"]

TrainState = train_state.TrainState
DATA, MODEL = "data", "model"


@dataclass(frozen=True)
class GPTConfig:
    """Model, optimizer and data sizes. Frozen and hashable: it keys the cached model and optimizer."""

    vocab: int = 256
    seq_len: int = 64
    d_model: int = 128
    layers: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    learning_rate: float = 3e-3
    warmup_steps: int = 5
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    noise: float = 0.1  # share of tokens in the synthetic data that break the chain

    def __post_init__(self) -> None:
        if self.d_model % self.heads:
            raise ValueError(f"d_model={self.d_model} is not a multiple of heads={self.heads}")
        for name in ("vocab", "seq_len", "d_model", "layers", "heads", "mlp_ratio"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads

    @property
    def d_mlp(self) -> int:
        return self.mlp_ratio * self.d_model

    def check_mesh(self, mesh: Mesh) -> None:
        """Raise ValueError if a tensor-parallel dimension does not divide by the ``model`` axis."""
        m = mesh.shape[MODEL]
        for name, n in (("heads", self.heads), ("vocab", self.vocab), ("d_mlp", self.d_mlp)):
            if n % m:
                raise ValueError(f"{name}={n} is not divisible by the mesh's model axis ({m})")


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        c = self.cfg
        t = x.shape[1]
        h = nn.LayerNorm(name="ln1")(x)
        # One kernel (d, 3, heads, head_dim): heads are what the model axis splits.
        qkv = nn.DenseGeneral((3, c.heads, c.head_dim), name="qkv")(h)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(c.head_dim)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        att = jnp.where(causal, att, jnp.finfo(att.dtype).min)
        y = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(att, axis=-1), v)
        x = x + nn.DenseGeneral(c.d_model, axis=(-2, -1), name="proj")(y)
        h = nn.LayerNorm(name="ln2")(x)
        h = nn.Dense(c.d_mlp, name="fc_in")(h)
        return x + nn.Dense(c.d_model, name="fc_out")(jax.nn.gelu(h))


class GPT(nn.Module):
    """Decoder-only LM: tokens (batch, seq) -> logits (batch, seq, vocab)."""

    cfg: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        c = self.cfg
        wte = nn.Embed(c.vocab, c.d_model, embedding_init=nn.initializers.normal(0.02), name="wte")
        wpe = self.param("wpe", nn.initializers.normal(0.02), (c.seq_len, c.d_model))
        x = wte(tokens) + wpe[: tokens.shape[1]]
        for i in range(c.layers):
            x = Block(c, name=f"block_{i}")(x)
        return wte.attend(nn.LayerNorm(name="ln_f")(x))


@functools.lru_cache(maxsize=None)
def make_model(cfg: GPTConfig) -> GPT:
    """The model for ``cfg`` (one object per config, so TrainState treedefs compare equal)."""
    return GPT(cfg)


@functools.lru_cache(maxsize=None)
def make_optimizer(cfg: GPTConfig) -> optax.GradientTransformation:
    """Clipped AdamW with linear warm-up (one object per config, like ``make_model``)."""
    lr = optax.linear_schedule(0.0, cfg.learning_rate, max(cfg.warmup_steps, 1))
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm),
                       optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay))


def make_mesh(model: int | None = None, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ('data', 'model') mesh over ``devices`` (default: all); ``model`` defaults to 2 when it divides.

    8 devices give data=4 x model=2. Axes are Auto so that shardings propagate through the step.
    """
    devs = list(devices if devices is not None else jax.devices())
    n = len(devs)
    if model is None:
        model = 2 if n % 2 == 0 else 1
    if model < 1 or n % model:
        raise ValueError(f"model axis {model} does not divide {n} devices")
    return Mesh(np.array(devs).reshape(n // model, model), (DATA, MODEL))


# (module, param) -> spec. Column-parallel into heads / MLP units, row-parallel out of them: one all-reduce per
# sub-layer, as in Megatron; the embedding is split over the vocabulary (the tied head then is too).
_RULES: dict[tuple[str, str], P] = {
    ("wte", "embedding"): P(MODEL, None),
    ("qkv", "kernel"): P(None, None, MODEL, None),
    ("qkv", "bias"): P(None, MODEL, None),
    ("proj", "kernel"): P(MODEL, None, None),
    ("fc_in", "kernel"): P(None, MODEL),
    ("fc_in", "bias"): P(MODEL),
    ("fc_out", "kernel"): P(MODEL, None),
}


def _names(path: tuple) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _spec(path: tuple, ndim: int) -> P:
    names = _names(path)
    spec = _RULES.get(tuple(names[-2:]), P()) if len(names) >= 2 else P()
    # Optimizer moments mirror the params' paths and shapes; counters and scalars stay replicated.
    return spec if len(spec) == ndim else P()


def _create_state(cfg: GPTConfig, key: jax.Array) -> TrainState:
    model = make_model(cfg)
    params = model.init(key, jnp.zeros((1, cfg.seq_len), jnp.int32))["params"]
    state = TrainState.create(apply_fn=model.apply, params=params, tx=make_optimizer(cfg))
    # A strongly typed step counter: a restored one (never weakly typed) then hits the same compiled step.
    return state.replace(step=jnp.zeros((), jnp.int32))


def _shapes(cfg: GPTConfig) -> TrainState:
    return jax.eval_shape(functools.partial(_create_state, cfg), jax.random.key(0))


def state_shardings(cfg: GPTConfig, mesh: Mesh) -> TrainState:
    """A TrainState of NamedShardings: params and AdamW moments tensor-parallel on 'model', the rest replicated."""
    cfg.check_mesh(mesh)
    return jax.tree_util.tree_map_with_path(lambda p, s: NamedSharding(mesh, _spec(p, len(s.shape))), _shapes(cfg))


def abstract_state(cfg: GPTConfig, mesh: Mesh) -> TrainState:
    """The restore target: the state's structure with ``jax.ShapeDtypeStruct`` leaves carrying its shardings."""
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        _shapes(cfg), state_shardings(cfg, mesh))


def init_state(cfg: GPTConfig, mesh: Mesh, seed: int = 0) -> TrainState:
    """A freshly initialised TrainState laid out with ``state_shardings`` (same seed, same bits)."""
    return _init_fn(cfg, mesh)(jax.random.key(seed))


@functools.lru_cache(maxsize=None)
def _init_fn(cfg: GPTConfig, mesh: Mesh) -> Callable[[jax.Array], TrainState]:
    return jax.jit(functools.partial(_create_state, cfg), out_shardings=state_shardings(cfg, mesh))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batches are split over 'data' and replicated over 'model'."""
    return NamedSharding(mesh, P(DATA, None))


def make_train_step(cfg: GPTConfig, mesh: Mesh) -> Callable[[TrainState, jax.Array], tuple[TrainState, jax.Array]]:
    """``step(state, batch) -> (state, loss)``, jitted with fixed in/out shardings and the state donated.

    ``batch`` is int32 (batch, seq_len + 1): inputs are ``batch[:, :-1]``, next-token targets ``batch[:, 1:]``.
    Pinning the output shardings to the input ones keeps the state's layout (and the restore target) fixed.
    """
    shardings = state_shardings(cfg, mesh)

    def step(state: TrainState, batch: jax.Array) -> tuple[TrainState, jax.Array]:
        def loss_fn(params: Any) -> jax.Array:
            logits = state.apply_fn({"params": params}, batch[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), loss

    return jax.jit(step, in_shardings=(shardings, batch_sharding(mesh)),
                   out_shardings=(shardings, NamedSharding(mesh, P())), donate_argnums=0)


def batch_at(cfg: GPTConfig, step: int, batch_size: int, seed: int = 0) -> np.ndarray:
    """The int32 (batch_size, seq_len + 1) batch of ``step``: a function of (seed, step) only.

    Each sequence follows the seed's fixed permutation of the vocabulary (next = perm[current]), except that a
    ``cfg.noise`` share of tokens is drawn uniformly; the loss can fall from ln(vocab) towards that noise floor.
    """
    perm = np.random.default_rng([seed, 0x5EED]).permutation(cfg.vocab)
    rng = np.random.default_rng([seed, step])
    n = cfg.seq_len + 1
    noise = rng.random((batch_size, n)) < cfg.noise
    rand = rng.integers(0, cfg.vocab, (batch_size, n))
    out = np.empty((batch_size, n), np.int64)
    out[:, 0] = rand[:, 0]
    for t in range(1, n):
        out[:, t] = np.where(noise[:, t], rand[:, t], perm[out[:, t - 1]])
    return out.astype(np.int32)


def device_batch(cfg: GPTConfig, mesh: Mesh, step: int, batch_size: int, seed: int = 0) -> jax.Array:
    """``batch_at`` placed on the mesh, split over 'data'.

    Every process computes the same host batch and places only its own devices' rows, so this also works on a
    mesh spanning several processes.
    """
    host = batch_at(cfg, step, batch_size, seed)
    return jax.make_array_from_callback(host.shape, batch_sharding(mesh), lambda idx: host[idx])


def batches(cfg: GPTConfig, mesh: Mesh, batch_size: int, seed: int = 0, start: int = 0,
            stop: int | None = None) -> Iterator[tuple[int, jax.Array]]:
    """``(step, batch)`` for step = start, start + 1, ... (until ``stop``), each batch on the mesh split over
    'data'. Resuming at ``start`` yields the same batches an uninterrupted run sees."""
    if batch_size % mesh.shape[DATA]:
        raise ValueError(f"batch size {batch_size} is not divisible by the mesh's data axis ({mesh.shape[DATA]})")
    step = start
    while stop is None or step < stop:
        yield step, device_batch(cfg, mesh, step, batch_size, seed)
        step += 1


def state_bytes(state: Any) -> int:
    """Global bytes of the array leaves of ``state`` (each array counted once, whatever its replication)."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(state) if hasattr(x, "shape") and hasattr(x, "dtype"))


def param_count(cfg: GPTConfig) -> int:
    """Number of model parameters for ``cfg``."""
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(_shapes(cfg).params))
