"""Registered losses: optax values, and their distributions' square roots."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import kfac_jax_lite as kfl
from kfac_jax_lite.losses import distributions as dists
from kfac_jax_lite.tagging._tagged import find_loss_tags

KEY = jax.random.PRNGKey(0)
LOGITS = jax.random.normal(KEY, (4, 3))
INT_LABELS = jnp.array([0, 2, 1, 1])
ONE_HOT = jax.nn.one_hot(INT_LABELS, 3)


@pytest.mark.parametrize("name,args", [
    ("softmax_cross_entropy", (LOGITS, ONE_HOT)),
    ("softmax_cross_entropy_with_integer_labels", (LOGITS, INT_LABELS)),
    ("sigmoid_binary_cross_entropy", (LOGITS, ONE_HOT)),
    ("squared_error", (LOGITS, ONE_HOT)),
    ("l2_loss", (LOGITS, ONE_HOT)),
])
def test_same_values_and_gradients_as_optax(name, args):
  ours, theirs = getattr(kfl, name), getattr(optax, name)
  np.testing.assert_allclose(ours(*args), theirs(*args), rtol=1e-6)
  grad = lambda f: jax.grad(lambda x: f(x, *args[1:]).mean())(args[0])
  np.testing.assert_allclose(grad(ours), grad(theirs), rtol=1e-6)
  # Under jit, vmap and second-order autodiff too.
  hess = jax.jit(jax.hessian(lambda x: ours(x, *args[1:]).sum()))(args[0])
  hess_ref = jax.hessian(lambda x: theirs(x, *args[1:]).sum())(args[0])
  np.testing.assert_allclose(hess, hess_ref, rtol=1e-5, atol=1e-6)
  per_row = jax.vmap(lambda x, *a: ours(x[None], *(t[None] for t in a))[0])(*args)
  np.testing.assert_allclose(per_row, theirs(*args), rtol=1e-6)


def test_the_tag_is_in_the_jaxpr_with_outputs_and_targets():
  jaxpr = jax.make_jaxpr(
      lambda x: kfl.softmax_cross_entropy(x, ONE_HOT).mean())(LOGITS)
  ((key, eqn),) = find_loss_tags(jaxpr.jaxpr)
  assert key == (len(jaxpr.jaxpr.eqns) - 3,)  # Before the sum and the divide.
  assert isinstance(eqn.params["distribution"], dists.Categorical)
  assert [v.aval.shape for v in eqn.invars] == [(4,), (4, 3), (4, 3)]


DISTS = [
    (dists.Categorical(), (LOGITS,)),
    (dists.Bernoulli(), (LOGITS,)),
    (dists.Normal(0.5), (LOGITS,)),
    (dists.NormalMeanVariance(), (LOGITS, jnp.exp(LOGITS))),
]


@pytest.mark.parametrize("index", range(len(DISTS)))
def test_fisher_sqrt_is_expected_outer_product_of_sampled_gradients(index):
  dist, outputs = DISTS[index]
  keys = jax.random.split(KEY, 40000)

  def grads(key):
    targets = dist.sample(key, outputs)
    return jax.grad(lambda o: dist.loss(o, targets).sum())(outputs)

  # One Fisher per loss element: [elements, event entries of all outputs].
  elements = dist.loss(outputs, dist.sample(KEY, outputs)).size
  g = jax.vmap(grads)(keys)
  g = jnp.concatenate([x.reshape(len(keys), elements, -1) for x in g], -1)
  sampled = jnp.einsum("sni,snj->nij", g, g) / len(keys)
  roots = dist.fisher_sqrt(outputs)
  b = jnp.concatenate([r.reshape(elements, -1, r.shape[-1]) for r in roots], 1)
  exact = b @ jnp.swapaxes(b, -1, -2)
  np.testing.assert_allclose(sampled, exact, atol=0.05 * np.abs(exact).max())


@pytest.mark.parametrize("index", range(3))
def test_ggn_equals_fisher_for_natural_parameters(index):
  dist, outputs = DISTS[index]
  targets = dist.sample(KEY, outputs)
  hess = jax.vmap(jax.hessian(lambda o, t: dist.loss((o,), (t,)).sum()))(
      outputs[0], targets[0])
  b = dist.ggn_sqrt(outputs, targets)[0]
  if dist.event_ndims == (0,):  # Elementwise: a 1x1 Hessian per element.
    np.testing.assert_allclose(b[..., 0] ** 2, jnp.diagonal(hess, 0, -2, -1), rtol=1e-5)
  else:
    np.testing.assert_allclose(b @ jnp.swapaxes(b, -1, -2), hess, atol=1e-6)


def test_mean_variance_normal_ggn_is_psd_part_of_hessian_and_differs():
  dist, outputs = DISTS[3]
  targets = (outputs[0] + 2.0,)
  mean, var = outputs[0][0, 0], outputs[1][0, 0]
  hess = jax.hessian(lambda mv: dist.loss((mv[0], mv[1]), (targets[0][0, 0],)))(
      jnp.stack([mean, var]))
  w, q = np.linalg.eigh(hess)
  psd = (q * np.maximum(w, 0)) @ q.T
  b = jnp.stack([r[0, 0] for r in dist.ggn_sqrt(outputs, targets)])
  np.testing.assert_allclose(b @ b.T, psd, rtol=1e-4, atol=1e-6)
  f = jnp.stack([r[0, 0] for r in dist.fisher_sqrt(outputs)])
  assert not np.allclose(f @ f.T, b @ b.T, atol=1e-3)


def test_custom_distribution_in_a_few_lines():
  import dataclasses

  @dataclasses.dataclass(frozen=True)
  class UnitLaplace(kfl.PredictiveDistribution):
    event_ndims = (0,)

    def loss(self, outputs, targets):
      return jnp.abs(outputs[0] - targets[0])

    def sample(self, key, outputs):
      return (outputs[0] + jax.random.laplace(key, outputs[0].shape),)

    def fisher_sqrt(self, outputs):
      return (jnp.ones(outputs[0].shape + (1,)),)

  values = kfl.registered_loss(UnitLaplace(), LOGITS, ONE_HOT)
  np.testing.assert_allclose(values, jnp.abs(LOGITS - ONE_HOT))
  with pytest.raises(NotImplementedError, match="ggn_sqrt"):
    dists.NormalMeanVariance.__mro__[1].ggn_sqrt(
        dataclasses.replace(dists.NormalMeanVariance()), None, None)
