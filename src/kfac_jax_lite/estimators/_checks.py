"""The argument checks of the estimation layer: the ``estimation`` modes
and what each needs of the loss and the batch (``kfl.kfac``,
``kfl.kfac_optimizer``, ``kfl.eigen_adam``, ``kfl.value_grad_and_stats``,
``kfl.describe`` and ``kfl.laplace.fit`` call them when built, so that a
bad argument fails before any step)."""
from __future__ import annotations

from kfac_jax_lite import tagging

ESTIMATIONS = ("fisher", "empirical", "empirical_shared", "curvature_prop",
               "exact", "curvature_prop_ggn", "exact_ggn")
"""The ``estimation`` modes (see the module doc)."""
# The modes whose directions are not random: a fallback block gets the
# per-example gradients (N backward passes per sample), see the module doc.
PER_EXAMPLE_FALLBACKS = ("empirical", "exact", "exact_ggn")


def check_estimation(estimation, num_samples=1):
  if estimation not in ESTIMATIONS:
    raise ValueError(f"estimation must be one of {ESTIMATIONS}, got "
                     f"{estimation!r}")
  if not (isinstance(num_samples, int) and num_samples >= 1):
    raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")


def check_example_axis(example_axis, batch, stats_fraction, where):
  """``example_axis`` must name one axis of ``batch``'s leaves (a
  ``ValueError`` otherwise, ``tagging.resolve_example_axis``), the leading
  one when ``stats_fraction < 1`` (which slices it)."""
  if example_axis is None:
    return
  try:
    axes = tagging.resolve_example_axis(batch, example_axis)
  except ValueError as e:
    raise ValueError(f"{where}: {e}") from None
  if stats_fraction < 1 and any(a not in (None, 0) for a in axes):
    raise ValueError(f"{where}: stats_fraction < 1 takes the first examples "
                     "along the leading axis; with example_axis="
                     f"{example_axis!r} use stats_fraction=1")


def check_has_loss(tagged, estimation, where):
  """Raises unless ``estimation`` can be computed from ``tagged``'s trace.

  Every estimation but ``"empirical"`` draws its output cotangents from a
  loss's predictive distribution (``u = ∇_z ℓ(z, t)`` with ``t`` sampled,
  or the loss's Hessian factor): a registered loss, or a standard one
  recognised in the jaxpr (``kfl.tagging``); without one only the empirical
  statistics (the per-example gradients, a mean over the batch assumed) are
  defined. Checked when ``where`` (``kfl.kfac``'s ``tx.init``,
  ``kfl.kfac_optimizer``'s ``tx.init``, ``kfl.value_grad_and_stats``,
  ``kfl.describe`` given an estimation, ``kfl.laplace.fit``) is built or
  initialised, so the error comes before any step.

  Args:
    tagged: the ``tagging.TaggedLoss`` of the loss function.
    estimation: the configured estimation mode.
    where: the API named in the error.
  """
  partial = partial_loss(tagged)
  if partial:
    raise ValueError(f"{where}: {partial}")
  if tagged.losses or estimation in ("empirical", "empirical_shared"):
    return
  seen = ("; its terms: " + "; ".join(tagged.unrecognised)
          if tagged.unrecognised else "")
  raise ValueError(
      f"{where}: estimation={estimation!r} needs a registered or recognised "
      f"loss, and none was found in loss_fn{seen}. Compute the loss with "
      "kfl.softmax_cross_entropy, "
      "kfl.softmax_cross_entropy_with_integer_labels, "
      "kfl.sigmoid_binary_cross_entropy, kfl.squared_error (or "
      "kfl.registered_loss), or with optax's namesakes or a standard form "
      "written out (recognised: see kfl.describe), or use "
      "estimation='empirical' (per-example gradients; any batch)")


def partial_loss(tagged) -> str | None:
  """Why ``tagged``'s recognised loss is only part of the loss, or None.

  Issue 38: a Gaussian negative log-likelihood with a predicted scale,
  written ``-Normal(mu, sigma).log_prob(y)`` (TensorFlow Probability) or by
  hand as ``½((y - mu)/sigma)² + log sigma``, is recognised as a squared
  error of variance 1 on the standardised residual ``(y - mu)/sigma``
  (targets zeros), with the ``log sigma`` term not recognised: a curvature
  model that is wrong for ``sigma``. That pattern (a recognised ``Normal``
  with zeros as targets beside an unrecognised term through ``log``) is
  refused for every estimation, naming ``kfl.gaussian_nll``, whose
  curvature models the variance; ``describe`` says it too. A squared error
  with data targets, or a ``log`` term beside a loss of another kind, is
  left as it is (``describe`` lists the unrecognised terms)."""
  logs = [u for u in tagged.unrecognised if "`log`" in u]
  for t in tagged.losses:
    r = t.recognised
    if (r is not None and type(t.distribution).__name__ == "Normal"
        and r.target == "zeros" and logs):
      return (
          "the loss looks like a Gaussian negative log-likelihood with a "
          "predicted scale (-Normal(mu, sigma).log_prob(y), or "
          "((y - mu)/sigma)**2/2 + log(sigma)): only its standardised "
          "residual is recognised, as a squared error of variance 1 with "
          f"targets zeros ({r.form}), and its {logs[0]} is not, so the "
          "curvature would be wrong for sigma. Write it with "
          "kfl.gaussian_nll(mean, variance, targets) (variance = sigma**2), "
          "whose curvature models the predicted variance")
  return None
