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


def rounding_tol(dtype, terms, scale, depth=1, cond=1.0):
  """The absolute difference rounding allows between two computations of
  one quantity in ``dtype`` (two code paths, or one on two CPUs).

  A sum of ``n`` products computed in floating point, in any order and by
  any kernel, is within ``γ_n Σ|terms| ≈ n·u·Σ|terms|`` of the exact sum
  (``u = ε/2``; Higham, *Accuracy and Stability of Numerical Algorithms*,
  §3.1), so two such computations are within ``n·ε·Σ|terms|`` of each
  other. A result that chains ``depth`` reductions (a forward and a
  backward pass through layers) adds their bounds. Returns
  ``depth·n·ε·scale``.

  Args:
    dtype: the precision computed in (the lower of the two sides').
    terms: ``n``, the longest reduction a result entry goes through (the
      batch, a contraction's width, their product for a covariance of
      cotangents summed over a batch).
    scale: the size of the summed terms, ``Σ|terms|``; ``max |desired|``
      where they do not cancel (a PSD matrix's largest entry bounds its
      off-diagonal terms by Cauchy–Schwarz).
    depth: the number of chained reductions.
    cond: the condition number of a solve the result then goes through
      (a relative perturbation of the data moves the solution by up to
      ``cond`` times as much; Higham §7.1), e.g. ``kron_cond_bound``.
  """
  return (depth * terms * float(np.finfo(dtype).eps) * float(scale)
          * float(cond))


def low_precision(*arrays):
  """The least precise floating dtype among ``arrays`` (float64 if none)."""
  dtypes = [np.asarray(a).dtype for a in arrays]
  floats = [d for d in dtypes if np.issubdtype(d, np.floating)]
  return max(floats, key=lambda d: np.finfo(d).eps, default=np.float64)


def assert_rounding_close(actual, desired, terms, depth=1, scale=None,
                          cond=1.0, err_msg=""):
  """``|actual − desired| ≤ rounding_tol(...)`` entrywise, in the lower
  precision of the two, with ``scale = max |desired|`` unless given."""
  dtype = low_precision(actual, desired)
  desired64 = np.asarray(desired, np.float64)
  if scale is None:
    scale = np.abs(desired64).max(initial=0.0)
  np.testing.assert_allclose(
      np.asarray(actual), desired64, rtol=0,
      atol=rounding_tol(dtype, terms, scale, depth, cond), err_msg=err_msg)


def assert_power_close(actual, m, exp, err_msg=""):
  """``actual`` is ``m^exp`` (``m`` symmetric positive definite, given in
  float64) up to what rounding in ``actual``'s precision allows.

  A backward-stable decomposition perturbs ``m`` by ``(n + c)·ε·‖m‖``
  (``n`` products in each entry, ``c ≤ 4`` roundings of forming and casting
  ``m``, of each eigenvalue's power), which moves ``m^p`` by at most
  ``|p|·(n + c)·ε·κ(m)·‖m^p‖`` (the derivative ``p·λ^(p−1)`` at the
  smallest eigenvalue for ``p < 0``, at the largest for ``p ≥ 1``;
  ``κ^(1−p) ≤ κ`` between): the forward error of a backward-stable
  inverse. Twice for the two passes (the decomposition, then the solves or
  the eigenvector products), and twice for the two sides (the float64
  reference has the same bound in float64)."""
  m = np.asarray(m, np.float64)
  assert_rounding_close(actual, sym_power(m, exp), terms=len(m) + 4,
                        depth=4 * max(1.0, abs(exp)), cond=np.linalg.cond(m),
                        err_msg=err_msg)


def kron_cond_bound(stats, damping):
  """An upper bound on the condition number of every π-damped Kronecker
  block ``(A + π√λ I) ⊗ (G + √λ/π I)`` of ``stats`` (block name → statistics
  with ``a``, ``g`` of shape ``[1, n, n]``, or ``a`` a diagonal ``[1, n]``):
  ``κ ≤ (1 + tr A/(π√λ))(1 + π tr G/√λ)`` (a PSD matrix's eigenvalues are at
  most its trace), the largest over the blocks."""
  bound = 1.0
  for name, s in stats.items():
    if name == kfl_run_entry():  # The loss and target count, no block.
      continue
    a, g = (np.asarray(x, np.float64)[0] for x in (s.a, s.g))
    tr_a = a.sum() if a.ndim == 1 else np.trace(a)
    tr_g = np.trace(g)
    pi = np.sqrt((tr_a / len(a)) / (tr_g / len(g)))
    root = np.sqrt(damping)
    bound = max(bound, (1 + tr_a / (pi * root)) * (1 + pi * tr_g / root))
  return bound


def assert_paths_rounding_close(actual, desired, terms, depth=1):
  """``assert_rounding_close`` for each path of two dicts with the same
  keys (e.g. per-example gradients by parameter path), all at the scale of
  the largest entry of any path: a path's value can cancel to rounding
  noise while its terms have the others' size (an attention key's bias
  has zero gradient: softmax ignores a shift shared by all keys)."""
  assert set(actual) == set(desired), (sorted(actual), sorted(desired))
  scale = max(np.abs(np.asarray(x, np.float64)).max(initial=0.0)
              for x in desired.values())
  for path in desired:
    assert_rounding_close(actual[path], desired[path], terms, depth,
                          scale=scale, err_msg=str(path))


def split_batch(batch, sizes):
  """Consecutive slices of ``sizes`` examples of every leaf of ``batch``."""
  out, start = [], 0
  for s in sizes:
    out.append(jax.tree.map(lambda a: a[start:start + s], batch))
    start += s
  return out


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
  """``jax.jit(fn)`` compiled with XLA's default CPU back end: full
  optimisation and the fusion emitters.

  ``conftest.py`` makes XLA compile cheaply (``--xla_backend_optimization_
  level=0``, ``--xla_cpu_use_fusion_emitters=false``), which is right for
  the many tests whose time is compiling;
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
          {"xla_backend_optimization_level": 3,
           "xla_cpu_use_fusion_emitters": True})
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


def count_primitives(jaxpr, names, skip=()):
  """How many equations of each primitive in ``names`` ``jaxpr`` holds, the
  jaxprs inside it (cond branches, scan bodies, pjit calls) included but
  for the equations of the primitives in ``skip`` and what they hold."""
  counts = dict.fromkeys(names, 0)

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name in skip:
        continue
      if eqn.primitive.name in counts:
        counts[eqn.primitive.name] += 1
      for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          if hasattr(sub, "eqns"):
            walk(sub)
          elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
            walk(sub.jaxpr)
  walk(jaxpr)
  return counts


def kfl_run_entry():
  """The reserved ``Estimate.stats`` entry of the run's loss and bad-target
  count (``kfl.estimators.RUN_ENTRY``), not a block's statistics."""
  from kfac_jax_lite import estimators
  return estimators.RUN_ENTRY


def block_stats(stats):
  """``stats`` without the run entry (``kfl_run_entry``)."""
  return {k: v for k, v in stats.items() if k != kfl_run_entry()}


def two_layer_classifier_loss(p, b):
  """The 5-6-C tanh classifier of the fault tests (``test_faults``,
  ``test_planted_edges``): params ``{"l0", "l1"}: {"w", "b"}``, batch
  ``{"x", "y"}``, optax's integer-label cross-entropy, a mean."""
  import optax  # Only these tests need it here.
  h = jnp.tanh(b["x"] @ p["l0"]["w"] + p["l0"]["b"])
  logits = h @ p["l1"]["w"] + p["l1"]["b"]
  return optax.softmax_cross_entropy_with_integer_labels(
      logits, b["y"]).mean()
