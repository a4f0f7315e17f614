"""kfl.laplace with several loss elements per example, against float64
brute force: regression over O = 2, 3 outputs (a mean over N·O, a sum, a
sum over outputs then a mean over examples), per-token cross-entropy (with
and without a mask) and sigmoid BCE over pixels.

The precision is ``Σ_n J_nᵀ H_n J_n + τI`` of the loss as written, a sum
over examples, never divided by the number of outputs or tokens: ``H_n``
is the Hessian in example n's outputs of ``λ_n = Σ_{e∈n} m_e ℓ_e``, the
sum of its elements' losses (``m_e`` the mask, 1 unmasked), written out
here with ``jnp`` and differentiated by ``jax.hessian``; ``J_n`` is
``jax.jacfwd`` of the outputs. ``post.loss`` is ``Σ_n λ_n``. The
log-determinant, the log marginal likelihood and the GLM predictive
variance are checked against the same brute-force precision.

    PYTHONPATH=src python tests/test_laplace_outputs.py   # the figures
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import kfac_jax_lite as kfl
from _helpers import split_batch, x64_mode

N, D_IN, H = 6, 3, 4
T, K = 2, 3  # Tokens per example and classes per token.
SIZES = (3, 3)  # Two batches.
STRUCTURES = ("full", "diag", "kron")


def mlp(p, x):
  """3 -> 4 (bias, tanh) -> + sin(odd) (a fallback) -> O (bias)."""
  return (jnp.tanh(x @ p["w1"] + p["b1"]) + jnp.sin(p["odd"])) @ p["w2"] + (
      p["b2"])


def _tokens(o):
  return o.reshape(o.shape[:-1] + (T, K))


def _sq(o, t):  # optax.squared_error, written out.
  return (o - t) ** 2


def _xent(o, y):  # Softmax cross-entropy per token, written out.
  z = _tokens(o)
  return -jnp.take_along_axis(jax.nn.log_softmax(z), y[..., None], -1)[..., 0]


def _bce(o, t):
  return jnp.logaddexp(0, o) - o * t


# name -> (outputs, kfl loss(o, batch), per-element λ(o_n, batch_n) [elems]
#          and mask(batch_n) [elems], for the brute force).
CASES = {
    "mean2": (2, lambda o, b: kfl.squared_error(o, b["t"]).mean(),
              lambda o, b: _sq(o, b["t"])),
    "mean3": (3, lambda o, b: kfl.squared_error(o, b["t"]).mean(),
              lambda o, b: _sq(o, b["t"])),
    "sum2": (2, lambda o, b: kfl.squared_error(o, b["t"]).sum(),
             lambda o, b: _sq(o, b["t"])),
    "sum3": (3, lambda o, b: kfl.squared_error(o, b["t"]).sum(),
             lambda o, b: _sq(o, b["t"])),
    "sum_mean2": (2, lambda o, b: kfl.squared_error(o, b["t"]).sum(-1).mean(),
                  lambda o, b: _sq(o, b["t"])),
    "sum_mean3": (3, lambda o, b: kfl.squared_error(o, b["t"]).sum(-1).mean(),
                  lambda o, b: _sq(o, b["t"])),
    "tokens": (T * K, lambda o, b: kfl.softmax_cross_entropy_with_integer_labels(
        _tokens(o), b["y"]).mean(), lambda o, b: _xent(o, b["y"])),
    "masked_tokens": (
        T * K, lambda o, b: (kfl.softmax_cross_entropy_with_integer_labels(
            _tokens(o), b["y"]) * b["mask"]).sum() / b["mask"].sum(),
        lambda o, b: _xent(o, b["y"]) * b["mask"]),
    "pixels": (3, lambda o, b: kfl.sigmoid_binary_cross_entropy(
        o, b["px"]).mean(), lambda o, b: _bce(o, b["px"])),
}


def _data(out):
  rng = np.random.default_rng(out)
  f = lambda *s: jnp.asarray(rng.standard_normal(s))
  params = {"w1": f(D_IN, H), "b1": 0.3 * f(H), "odd": f(H),
            "w2": f(H, out), "b2": 0.3 * f(out)}
  mask = np.ones((N, T))
  mask[0] = 0  # A weightless example,
  mask[4, 1] = 0  # and one with one of its two tokens.
  batch = {"x": f(N, D_IN), "t": f(N, out),
           "y": jnp.asarray(rng.integers(0, K, (N, T))),
           "mask": jnp.asarray(mask),
           "px": jnp.asarray(rng.integers(0, 2, (N, out)), jnp.float64)}
  return params, batch


def _split(batch):
  return split_batch(batch, SIZES)


@functools.lru_cache(maxsize=None)
def fitted(case, structure, estimation="exact_ggn"):
  out, loss, _ = CASES[case]
  params, batch = _data(out)
  return kfl.laplace.fit(lambda p, b: loss(mlp(p, b["x"]), b), params,
                         _split(batch), structure=structure,
                         estimation=estimation, progress=False)


# --- brute force (float64, independent of the library) -------------------

def _example_loss(case):
  elems = CASES[case][2]
  return lambda o, b: jnp.sum(elems(o, b))


@functools.lru_cache(maxsize=None)
def brute(case, empirical=False):
  """``(ggn [P, P], kron [P, P], loss, jac [N, O, P])`` of the case (with
  ``empirical``, ``H_n`` replaced by ``∇λ_n ∇λ_nᵀ``, the outer product of
  the gradient of example n's summed loss at the data), with ``kron`` the
  K-FAC precision by definition: per dense layer ``A ⊗ G``,
  ``A`` the example-weighted mean of the batches' ``āāᵀ`` (weights ``k_n``
  the number of elements that count in example n, normalised per batch,
  batches weighted by their examples of positive weight), ``G = Σ_n J_zᵀ
  H_n J_z`` (``J_z``: the outputs' Jacobian in the layer's
  pre-activation); the fallback ``odd`` gets its exact diagonal."""
  out = CASES[case][0]
  params, batch = _data(out)
  lam = _example_loss(case)
  flat, unravel = ravel_pytree(params)
  one = lambda f, x: mlp(unravel(f), x[None])[0]
  jac = np.asarray(jax.vmap(jax.jacfwd(one), (None, 0))(flat, batch["x"]))
  o = mlp(params, batch["x"])
  per_ex = [jax.tree.map(lambda a: a[n], batch) for n in range(N)]
  hess = np.stack([np.asarray(jax.hessian(lam)(o[n], per_ex[n]))
                   for n in range(N)])
  if empirical:
    grad = np.stack([np.asarray(jax.grad(lam)(o[n], per_ex[n]))
                     for n in range(N)])
    hess = grad[:, :, None] * grad[:, None, :]
  loss = float(sum(lam(o[n], per_ex[n]) for n in range(N)))
  ggn = np.einsum("nop,noq,nqr->pr", jac, hess, jac)
  # K-FAC: the A weights, from the elements that count per example.
  counts = (np.asarray(batch["mask"]).sum(1) if case == "masked_tokens"
            else np.ones(N))
  weights, start, total = np.zeros(N), 0, np.sum(counts > 0)
  for s in SIZES:
    k = counts[start:start + s]
    weights[start:start + s] = np.sum(k > 0) * k / k.sum() / total
    start += s
  x = np.asarray(batch["x"])
  z1 = x @ np.asarray(params["w1"]) + np.asarray(params["b1"])
  h = np.tanh(z1) + np.sin(np.asarray(params["odd"]))
  w2 = np.asarray(params["w2"])
  j2 = np.broadcast_to(np.eye(out), (N, out, out))  # ∂o/∂z2
  j1 = np.einsum("ho,nh->noh", w2, 1 - np.tanh(z1) ** 2)  # ∂o/∂z1
  a1 = np.concatenate([x, np.ones((N, 1))], 1)
  a2 = np.concatenate([h, np.ones((N, 1))], 1)
  # Raveled positions (keys sort: b1, b2, odd, w1, w2).
  b1 = np.arange(H)
  b2 = H + np.arange(out)
  odd = H + out + np.arange(H)
  w1 = 2 * H + out + np.arange(D_IN * H).reshape(D_IN, H)
  w2i = 2 * H + out + D_IN * H + np.arange(H * out).reshape(H, out)
  kron = np.zeros_like(ggn)
  for a, j, rows in ((a1, j1, np.concatenate([w1, b1[None]])),
                     (a2, j2, np.concatenate([w2i, b2[None]]))):
    big_a = np.einsum("n,ni,nj->ij", weights, a, a)
    big_g = np.einsum("noi,nop,npj->ij", j, hess, j)
    idx = rows.ravel()
    kron[np.ix_(idx, idx)] = np.kron(big_a, big_g)
  kron[odd, odd] = np.diag(ggn)[odd]
  return ggn, kron, loss, jac


def _want(case, structure, empirical=False):
  ggn, kron, _, _ = brute(case, empirical)
  return {"full": ggn, "diag": np.diag(np.diag(ggn)), "kron": kron}[structure]


def _rel(got, want):
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.abs(got - want).max() / np.abs(want).max())


TAU = 0.7
RTOL = 1e-10  # float64: sums of ~10² products; far below any scale error.


@pytest.mark.parametrize("case", sorted(CASES))
def test_precision_and_loss_are_sums_over_examples(case):
  with x64_mode(True):
    want_loss = brute(case)[2]
    for structure in STRUCTURES:
      post = fitted(case, structure)
      want = _want(case, structure) + TAU * np.eye(len(_want(case, structure)))
      got = kfl.laplace.dense_precision(post, TAU)
      assert _rel(got, want) < RTOL, (structure, _rel(got, want))
      assert abs(float(post.loss) - want_loss) < RTOL * abs(want_loss), (
          structure, float(post.loss), want_loss)
      assert int(post.num_examples) == (N - 1 if case == "masked_tokens"
                                        else N)


@pytest.mark.parametrize("case", ["mean3", "masked_tokens"])
def test_logdet_evidence_and_predictive_follow(case):
  """log det P, the log marginal likelihood and the GLM covariance
  ``J P⁻¹ Jᵀ``, from the brute-force precision and loss."""
  with x64_mode(True):
    _, _, loss, jac = brute(case)
    params, batch = _data(CASES[case][0])
    theta = np.asarray(ravel_pytree(params)[0])
    for structure in STRUCTURES:
      post = fitted(case, structure)
      p = _want(case, structure) + TAU * np.eye(len(theta))
      sign, logdet = np.linalg.slogdet(p)
      assert sign == 1
      got = float(kfl.laplace.logdet(post, TAU))
      assert abs(got - logdet) < RTOL * abs(logdet), (structure, got, logdet)
      lml = -loss - 0.5 * (logdet - len(theta) * np.log(TAU)
                           + TAU * theta @ theta)
      got = float(kfl.laplace.log_marginal_likelihood(post, TAU))
      assert abs(got - lml) < RTOL * abs(lml), (structure, got, lml)
      want = np.einsum("nop,pq,nrq->nor", jac, np.linalg.inv(p), jac)
      _, cov = kfl.laplace.glm_moments(post, mlp, batch["x"], TAU)
      assert _rel(cov, want) < 1e-8, (structure, _rel(cov, want))


@pytest.mark.parametrize("case", ["mean3", "masked_tokens"])
def test_empirical_is_the_outer_product_of_each_examples_summed_loss(case):
  """"empirical" is "fisher" at the data's targets: with every element of
  weight 1 (0 masked) its columns are ``J_nᵀ ∇_o λ_n``, the gradient of
  example n's summed loss, not of its mean over outputs or tokens."""
  with x64_mode(True):
    for structure in STRUCTURES:
      post = fitted(case, structure, "empirical")
      want = _want(case, structure, empirical=True)
      got = np.asarray(kfl.laplace.dense_precision(post, TAU)) - TAU * (
          np.eye(len(want)))
      assert _rel(got, want) < RTOL, (structure, _rel(got, want))


def _figures():
  """Per case and structure: ``tr(H_fit) / tr(H_brute)`` and the max
  relative error of ``H``, and ``loss_fit / loss_brute``."""
  print("kfl.laplace.fit against brute force, float64 (ratio of traces of "
        "H, max |ΔH| / max |H|, ratio of losses)")
  with x64_mode(True):
    for case in CASES:
      cells = []
      for structure in STRUCTURES:
        post = fitted(case, structure)
        want = _want(case, structure)
        got = np.asarray(kfl.laplace.dense_precision(post, TAU)) - TAU * (
            np.eye(len(want)))
        cells.append(f"{structure} {np.trace(got) / np.trace(want):.4f} "
                     f"{_rel(got, want):.1e}")
      ratio = float(fitted(case, "kron").loss) / brute(case)[2]
      print(f"  {case:<14} " + "   ".join(cells) + f"   loss {ratio:.4f}")


if __name__ == "__main__":
  _figures()
