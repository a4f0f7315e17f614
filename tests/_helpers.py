"""Shared test helpers: float64 mode and independent references.

The references here are built from first principles (closed-form output
curvatures, autodiff Jacobians, dense linear algebra in float64) and never
call the library, so a test that compares the library with them cannot
pass by sharing its bug. Brute force for single blocks, from per-example
Jacobians of one layer, is in ``_brute``.
"""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree


def x64_mode(enabled: bool):
  """A context with float64 enabled (or a no-op)."""
  if not enabled:
    return contextlib.nullcontext()
  enable = getattr(jax, "enable_x64", None)
  if enable is None:  # Older JAX.
    from jax.experimental import enable_x64 as enable
  return enable(True)


def rand(key, shape, dtype=np.float64):
  """Standard normal test data of ``shape`` from seed ``key`` (numpy's
  generator: ``jax.random`` would compile a sampler per drawn shape)."""
  return np.random.default_rng(key).standard_normal(shape).astype(dtype)


def flat(tree):
  """A pytree's leaves, raveled and concatenated, as float64 numpy."""
  leaves = jax.tree.leaves(tree)
  if not leaves:
    return np.zeros(0)
  return np.concatenate([np.asarray(x, np.float64).ravel() for x in leaves])


# --- output curvatures, from first principles --------------------------------

def softmax_fisher(logits):
  """``diag(p) − p pᵀ`` per row of ``logits [..., K]`` (= the Hessian of the
  softmax cross-entropy in the logits, whatever the label)."""
  z = np.asarray(logits, np.float64)
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.vectorize(np.diag, signature="(k)->(k,k)")(p) - p[..., :, None] * p[..., None, :]


def sigmoid_fisher(logits):
  """``diag(σ(z)(1 − σ(z)))`` per row of ``logits [..., K]``."""
  s = 1 / (1 + np.exp(-np.asarray(logits, np.float64)))
  return np.vectorize(np.diag, signature="(k)->(k,k)")(s * (1 - s))


def psd_part(h):
  """``H₊``: a symmetric ``h [..., n, n]`` with negative eigenvalues zeroed."""
  w, q = np.linalg.eigh(np.asarray(h, np.float64))
  return (q * np.maximum(w, 0)[..., None, :]) @ np.swapaxes(q, -1, -2)


def sym_power(m, exp):
  """``m^exp`` for a symmetric positive definite ``m``."""
  w, q = np.linalg.eigh(np.asarray(m, np.float64))
  return (q * w ** exp) @ q.T


# --- K-FAC of a tanh MLP, by brute force -------------------------------------

def mlp_forward(layers, x):
  """``[(input, pre-activation)]`` per layer and the logits of a tanh MLP
  ``layers = [(w [d_in, d_out], b [d_out])]`` (tanh on all but the last)."""
  out = []
  h = x
  for i, (w, b) in enumerate(layers):
    y = h @ w + b
    out.append((h, y))
    h = jnp.tanh(y) if i < len(layers) - 1 else y
  return out, h


def _head(layers, index):
  """The logits of one example as a function of layer ``index``'s
  pre-activation."""
  def head(y):
    h = y
    for j in range(index, len(layers)):
      if j > index:
        h = h @ layers[j][0] + layers[j][1]
      if j < len(layers) - 1:
        h = jnp.tanh(h)
    return h
  return head


def mlp_kfac_factors(layers, x, c, out_curvature=softmax_fisher):
  """``[(A, G)]`` per dense layer, as the design brief defines them.

  ``A = Σ_i w_i ā_i ā_iᵀ`` (``ā_i = [x_i, 1]``, ``w = c / Σc``) and
  ``G = Σ_i c_i J_iᵀ M_i J_i`` with ``J_i`` the Jacobian of example i's
  logits in the layer's pre-activation and ``M_i = out_curvature(logits_i)``
  (the exact output Fisher/GGN: what ``estimation="exact"`` estimates).
  """
  c = np.asarray(c, np.float64)
  w = c / c.sum()
  acts, logits = mlp_forward(layers, x)
  m = out_curvature(np.asarray(logits))
  out = []
  for index, (inp, y) in enumerate(acts):
    a = np.concatenate([np.asarray(inp, np.float64),
                        np.ones((len(inp), 1))], 1)
    jac = np.asarray(jax.vmap(jax.jacrev(_head(layers, index)))(y), np.float64)
    big_a = np.einsum("n,ni,nj->ij", w, a, a)
    big_g = np.einsum("n,nki,nkl,nlj->ij", c, jac, m, jac)
    out.append((big_a, big_g))
  return out


def kron_block(a, g):
  """``A ⊗ G`` over ``concat(W.ravel(), b)`` (W ``[d_in, d_out]`` row-major)."""
  return np.kron(a, g)


def damped_kron(a, g, damping, mode):
  """The damped block K-FAC inverts: ``A ⊗ G + λI`` (``"exact"``) or
  ``(A + π√λ I) ⊗ (G + √λ/π I)``, ``π = √((tr A/dim A)/(tr G/dim G))``
  (``"pi"``)."""
  if mode == "exact":
    return np.kron(a, g) + damping * np.eye(len(a) * len(g))
  pi = np.sqrt((np.trace(a) / len(a)) / (np.trace(g) / len(g)))
  root = np.sqrt(damping)
  return np.kron(a + pi * root * np.eye(len(a)), g + root / pi * np.eye(len(g)))


def mlp_ggn(layers, x, c, out_curvature=softmax_fisher):
  """The dense GGN ``Σ_i c_i J_iᵀ M_i J_i`` over all parameters, raveled
  like ``ravel_pytree(layers)``."""
  flat_p, unravel = ravel_pytree(layers)
  jac = jax.jacrev(lambda f: mlp_forward(unravel(f), x)[1])(flat_p)  # [N, K, P]
  jac = np.asarray(jac, np.float64)
  _, logits = mlp_forward(layers, x)
  m = out_curvature(np.asarray(logits))
  return np.einsum("n,nkp,nkl,nlq->pq", np.asarray(c, np.float64), jac, m, jac)


def optimized_jit(fn):
  """``jax.jit(fn)`` compiled with XLA's full CPU back-end optimisation.

  ``conftest.py`` makes XLA compile cheaply (``--xla_backend_optimization_
  level=0``), which is right for the many tests whose time is compiling;
  the few tests whose time is running a long ``lax.scan`` of training
  steps wrap it in this instead (a conv net trains ~5x slower at level 0).
  One compiled program per argument signature.
  """
  jitted = jax.jit(fn)
  compiled = {}

  def call(*args):
    leaves, treedef = jax.tree.flatten(args)
    key = (treedef, tuple((np.shape(x), jnp.result_type(x)) for x in leaves))
    if key not in compiled:
      compiled[key] = jitted.lower(*args).compile(
          {"xla_backend_optimization_level": 3})
    return compiled[key](*args)
  return call



def probe(tl, params, batch):
  """``(loss, param grads, captures, probe cotangents)`` of the rewritten
  loss of ``tl`` (a ``TaggedLoss``): one forward pass and its vjp. Call it
  inside a ``jax.jit``."""
  def f(p, probes):
    loss, _, caps = tl.apply(p, batch, probes)
    return loss, caps
  loss, vjp, caps = jax.vjp(f, params, tl.zero_probes(params, batch),
                            has_aux=True)
  grads, cts = vjp(jnp.ones_like(loss))
  return loss, grads, caps, cts

def per_example_and_reference(tl, ref_loss, params, batch):
  """``(rebuilt, vmap(grad))``: the per-example gradients rebuilt from the
  captures of ``tl`` (a ``TaggedLoss`` of a mean loss, so ``c_i = 1/N``)
  and those of ``ref_loss`` on one example at a time; one jitted program
  (with the suite's cheap compile, cheaper than the eager ops' many small
  ones). Probe keys below 0 (penalties) carry no layer data and are left
  out."""
  n = jax.tree.leaves(batch)[0].shape[0]

  @jax.jit
  def both(params, batch):
    _, _, caps, cts = probe(tl, params, batch)
    rebuilt = tl.per_example_grads(
        caps, {k: v * n for k, v in cts.items() if k >= 0})
    ref = jax.vmap(lambda ex: jax.grad(ref_loss)(
        params, jax.tree.map(lambda x: x[None], ex)))(batch)
    return rebuilt, ref
  return both(params, batch)
