"""The step's finiteness verdicts: ``factor.all_finite`` (one sum of
``x - x`` over packed leaves) and ``transform.guard`` (which uses it, with
the clipping scale applied in its pass) must be exact: any one non-finite
entry in any leaf is caught, and huge finite values (whose plain sums
overflow) are not mistaken for non-finite ones. float32 and float64."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _helpers import x64_mode
from kfac_jax_lite import factor as fac
from kfac_jax_lite.optimizers import transform

SHAPES = ((3, 4), (4,), (2, 2, 2), (130, 130))  # The last one unpacked.


@functools.lru_cache(maxsize=None)
def _all_finite(dtype_name):  # One compile per dtype (and x64 mode).
  del dtype_name
  return jax.jit(fac.all_finite)


def _tree(dtype):
  big = float(jnp.finfo(dtype).max)
  leaves = [jnp.full(s, big / 2, dtype) for s in SHAPES]
  # A low-precision leaf and an integer one ride along.
  return leaves + [jnp.ones((3,), jnp.bfloat16), jnp.arange(3)]


@pytest.mark.parametrize("x64", [False, True])
def test_all_finite_catches_any_one_entry_and_never_overflows(x64):
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    check = _all_finite(jnp.dtype(dtype).name)
    tree = _tree(dtype)
    # All entries at half the largest float: Σx overflows, Σ(x - x) does not.
    assert bool(check(tree))
    assert bool(check([]))
    for i, leaf in enumerate(tree[:len(SHAPES)]):
      for bad in (np.nan, np.inf, -np.inf):
        for where in ((0,) * leaf.ndim, tuple(d - 1 for d in leaf.shape)):
          poisoned = list(tree)
          poisoned[i] = leaf.at[where].set(bad)
          assert not bool(check(poisoned)), (i, bad, where)
    # +inf in one leaf and -inf in another: their sums must not cancel.
    both = list(tree)
    both[0] = tree[0].at[0, 0].set(np.inf)
    both[3] = tree[3].at[0, 0].set(-np.inf)
    assert not bool(check(both))
    if x64:  # A float64 value beyond float32's range is still finite.
      assert bool(check([jnp.full((2,), 1e300, jnp.float64),
                         jnp.ones((2,), jnp.float32)]))


@functools.lru_cache(maxsize=None)
def _guard(dtype_name):
  dtype = jnp.dtype(dtype_name)

  @jax.jit
  def guard(u, g, damping_ok):
    out, grads_ok, update_ok = transform.guard(
        u, g, damping_ok, transform.clip(u, g, 1.0, dtype))
    return out, grads_ok, update_ok, transform.inner_product(u, g, dtype)
  return guard


@pytest.mark.parametrize("x64", [False, True])
def test_guard_verdicts_are_exact(x64):
  with x64_mode(x64):
    dtype = jnp.float64 if x64 else jnp.float32
    guard = _guard(jnp.dtype(dtype).name)
    g = [jnp.full(s, 0.5, dtype) for s in SHAPES]
    u = [2 * x for x in g]
    yes = jnp.asarray(True)
    out, grads_ok, update_ok, inner = guard(u, g, yes)
    assert bool(grads_ok) and bool(update_ok)
    scale = min(1.0, float(np.sqrt(1.0 / float(inner))))
    for o, x in zip(out, u):
      np.testing.assert_allclose(o, scale * np.asarray(x), rtol=1e-6)
    # Finite but huge: ⟨u, g⟩ overflows, the exact checks say finite and
    # the clipping scale is 0 (a zero step), as the KL bound asks.
    huge = [jnp.full(s, float(jnp.finfo(dtype).max) / 4, dtype) for s in SHAPES]
    out, grads_ok, update_ok, inner = guard(huge, huge, yes)
    assert not np.isfinite(float(inner))
    assert bool(grads_ok) and bool(update_ok)
    assert all(np.all(np.asarray(o) == 0) for o in out)
    # One bad entry of the update (any leaf): the gradient is used.
    for i in range(len(SHAPES)):
      for bad in (np.nan, np.inf, -np.inf):
        bad_u = list(u)
        bad_u[i] = u[i].reshape(-1).at[-1].set(bad).reshape(u[i].shape)
        out, grads_ok, update_ok, _ = guard(bad_u, g, yes)
        assert bool(grads_ok) and not bool(update_ok), (i, bad)
        for o, x in zip(out, g):
          np.testing.assert_array_equal(o, x)
        # One bad gradient entry (and a finite update): a zero step.
        bad_g = list(g)
        bad_g[i] = bad_u[i]
        out, grads_ok, update_ok, _ = guard(u, bad_g, yes)
        assert not bool(grads_ok) and bool(update_ok), (i, bad)
        assert all(np.all(np.asarray(o) == 0) for o in out)
    # A bad damping: a zero step, the verdicts as they are.
    out, grads_ok, update_ok, _ = guard(u, g, jnp.asarray(False))
    assert bool(grads_ok) and bool(update_ok)
    assert all(np.all(np.asarray(o) == 0) for o in out)
