"""The benchmark models, each defined once.

Every script that trains or times one of these models imports it from
here, so a timing (``step_time.py``, ``kfac_jax_compare.py``, ...) and a
time-to-target table (``autoencoder.py``, ...) are about the same network.

* **MNIST autoencoder** (Hinton & Salakhutdinov 2006, as Martens & Grosse
  2015 and kfac-jax's example train it): dense layers ``dims`` (784-1000-
  500-250-30-250-500-1000-784 in full), tanh after every hidden layer
  except the narrowest, the code, which stays linear; logits out, sigmoid
  cross-entropy against the input summed over the pixels and averaged
  over the batch. Weights ``N(0, 1/fan_in)``, zero biases.
* **conv net** (``convnet.py``): 3x3 convolutions, each followed by a
  per-example normalisation of the whole feature map with a learned
  per-channel scale and shift and a ReLU, 2x2 average pooling between
  them, a global mean, a dense ReLU layer and a dense layer of logits;
  softmax cross-entropy averaged over the batch.
* **char LM** (``charlm.py``): a GPT-style pre-norm transformer over
  characters, causal self-attention and a GELU MLP per block; softmax
  cross-entropy per token averaged over batch and time.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

import _harness  # noqa: F401  (puts src/ on the path when not installed)
from _harness import kfl

# ----------------------------------------------------------- autoencoder

AUTOENCODER = (784, 1000, 500, 250, 30, 250, 500, 1000, 784)
AUTOENCODER_SMALL = (784, 256, 64, 256, 784)  # The timing scripts' --quick.
ACTIVATIONS = {"tanh": jnp.tanh, "relu": jax.nn.relu}


def autoencoder_init(dims, key):
  """Dense layers ``[{"w": [d_in, d_out], "b": [d_out]}]`` of ``dims``:
  weights ``N(0, 1/d_in)``, zero biases."""
  params = []
  for k, i, o in zip(jax.random.split(key, len(dims) - 1), dims[:-1], dims[1:]):
    params.append({"w": jax.random.normal(k, (i, o), jnp.float32) / np.sqrt(i),
                   "b": jnp.zeros((o,), jnp.float32)})
  return params


def autoencoder_logits(params, x, activation="tanh"):
  """``x [N, d]`` -> logits ``[N, d]``: ``activation`` after every layer
  except the narrowest (the code) and the output, which are linear."""
  act = ACTIVATIONS[activation]
  code = min(p["w"].shape[1] for p in params[:-1])
  h = x
  for i, layer in enumerate(params):
    h = h @ layer["w"] + layer["b"]
    if i < len(params) - 1 and layer["w"].shape[1] != code:
      h = act(h)
  return h


def make_autoencoder_loss(activation="tanh"):
  """``loss_fn(params, {"x": [N, d]})``: sigmoid cross-entropy of the
  logits against ``x``, summed over ``d`` and averaged over ``N``
  (registered with ``kfl.sigmoid_binary_cross_entropy``)."""
  def loss_fn(params, batch):
    out = autoencoder_logits(params, batch["x"], activation)
    return kfl.sigmoid_binary_cross_entropy(out, batch["x"]).sum(-1).mean()
  return loss_fn


autoencoder_loss = make_autoencoder_loss("tanh")


def autoencoder_kfac_jax_loss(params, batch):
  """:func:`autoencoder_loss` with kfac-jax's loss registration (kfac-jax
  is imported here, so only its virtualenv calls this)."""
  import kfac_jax
  out = autoencoder_logits(params, batch["x"])
  kfac_jax.register_sigmoid_cross_entropy_loss(out, batch["x"])
  return optax.sigmoid_binary_cross_entropy(out, batch["x"]).sum(-1).mean()


def random_problem(dims, batch_size, seed=0):
  """``(params, batch)``: :func:`autoencoder_init` and uniform inputs
  ``{"x": [batch_size, dims[0]]}`` (step time does not depend on the
  values)."""
  k_params, k_x = jax.random.split(jax.random.PRNGKey(seed))
  return autoencoder_init(dims, k_params), {
      "x": jax.random.uniform(k_x, (batch_size, dims[0]), jnp.float32)}


# -------------------------------------------------------------- conv net

def convnet_init(channels, hidden, key, in_channels=1, classes=10):
  """``conv{i}`` (3x3 HWIO kernels, He-scaled), ``norm{i}`` (unit scale,
  zero shift), ``dense0`` (He-scaled) and ``dense1`` (``N(0, 1/fan_in)``)."""
  keys = iter(jax.random.split(key, 2 * len(channels) + 2))
  params, c_in = {}, in_channels
  for i, c in enumerate(channels):
    fan_in = 9 * c_in
    params[f"conv{i}"] = {
        "w": (jax.random.normal(next(keys), (3, 3, c_in, c))
              * np.sqrt(2 / fan_in)),
        "b": jnp.zeros((c,))}
    params[f"norm{i}"] = {"scale": jnp.ones((c,)), "shift": jnp.zeros((c,))}
    c_in = c
  params["dense0"] = {
      "w": jax.random.normal(next(keys), (c_in, hidden)) * np.sqrt(2 / c_in),
      "b": jnp.zeros((hidden,))}
  params["dense1"] = {
      "w": jax.random.normal(next(keys), (hidden, classes)) / np.sqrt(hidden),
      "b": jnp.zeros((classes,))}
  return params


def convnet_logits(params, images):
  """``images [N, H, W]`` in [0, 1] -> ``[N, classes]``."""
  h = images[..., None]
  n_conv = sum(k.startswith("conv") for k in params)
  for i in range(n_conv):
    conv, norm = params[f"conv{i}"], params[f"norm{i}"]
    h = jax.lax.conv_general_dilated(
        h, conv["w"], (1, 1), "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC")) + conv["b"]
    mean = h.mean(axis=(1, 2, 3), keepdims=True)
    var = h.var(axis=(1, 2, 3), keepdims=True)
    h = (h - mean) * jax.lax.rsqrt(var + 1e-5) * norm["scale"] + norm["shift"]
    h = jax.nn.relu(h)
    if i < n_conv - 1 and h.shape[1] % 2 == 0 and h.shape[2] % 2 == 0:
      n, hh, ww, c = h.shape
      h = h.reshape(n, hh // 2, 2, ww // 2, 2, c).mean(axis=(2, 4))
  h = h.mean(axis=(1, 2))
  h = jax.nn.relu(h @ params["dense0"]["w"] + params["dense0"]["b"])
  return h @ params["dense1"]["w"] + params["dense1"]["b"]


def convnet_loss(params, batch):
  """Softmax cross-entropy of ``batch["x"]``'s logits against the integer
  labels ``batch["y"]``, averaged over the batch."""
  out = convnet_logits(params, batch["x"])
  return kfl.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()


def convnet_muon_dims(params):
  """Muon on the conv kernels (as (kh·kw·C_in) x C_out) and dense matrices."""
  dims = optax.contrib.MuonDimensionNumbers
  out = {}
  for name, layer in params.items():
    out[name] = {k: None for k in layer}
    if name.startswith("conv"):
      out[name]["w"] = dims(reduction_axis=(0, 1, 2), output_axis=3)
    elif name.startswith("dense"):
      out[name]["w"] = dims(reduction_axis=0, output_axis=1)
  return out


# --------------------------------------------------------------- char LM

def charlm_init(vocab, layers, width, context, key):
  """Token and position embeddings, ``layers`` pre-norm blocks (``qkv``,
  ``proj``, ``fc``, ``out`` dense layers; the residual branches' outputs
  scaled by ``1/sqrt(2·layers)``), a final norm and the ``head``."""
  keys = iter(jax.random.split(key, 4 * layers + 3))

  def dense(i, o, scale=1.0):
    return {"w": jax.random.normal(next(keys), (i, o)) * scale / np.sqrt(i),
            "b": jnp.zeros((o,))}

  def norm():
    return {"scale": jnp.ones((width,)), "shift": jnp.zeros((width,))}

  params = {"embed": jax.random.normal(next(keys), (vocab, width)) * 0.1,
            "position": jax.random.normal(next(keys), (context, width)) * 0.01}
  out_scale = 1 / np.sqrt(2 * layers)  # Residual branches start small.
  for l in range(layers):
    params[f"block{l}"] = {
        "norm1": norm(), "qkv": dense(width, 3 * width),
        "proj": dense(width, width, out_scale), "norm2": norm(),
        "fc": dense(width, 4 * width), "out": dense(4 * width, width, out_scale)}
  params["norm"] = norm()
  params["head"] = dense(width, vocab)
  return params


def _layer_norm(p, h):
  mean = h.mean(-1, keepdims=True)
  var = h.var(-1, keepdims=True)
  return (h - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["shift"]


def _attention(p, h, heads):
  b, t, d = h.shape
  q, k, v = jnp.split(h @ p["qkv"]["w"] + p["qkv"]["b"], 3, axis=-1)
  split = lambda x: x.reshape(b, t, heads, d // heads)
  q, k, v = split(q), split(k), split(v)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // heads)
  mask = jnp.tril(jnp.ones((t, t), bool))
  scores = jnp.where(mask, scores, -1e9)
  att = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
  return att.reshape(b, t, d) @ p["proj"]["w"] + p["proj"]["b"]


def charlm_logits(params, tokens, heads):
  """``tokens [B, T]`` int -> ``[B, T, vocab]``."""
  t = tokens.shape[1]
  h = params["embed"][tokens] + params["position"][:t]
  for l in range(sum(k.startswith("block") for k in params)):
    p = params[f"block{l}"]
    h = h + _attention(p, _layer_norm(p["norm1"], h), heads)
    m = jax.nn.gelu(_layer_norm(p["norm2"], h) @ p["fc"]["w"] + p["fc"]["b"])
    h = h + (m @ p["out"]["w"] + p["out"]["b"])
  h = _layer_norm(params["norm"], h)
  return h @ params["head"]["w"] + params["head"]["b"]


def make_charlm_loss(heads):
  """``loss_fn(params, {"x": tokens, "y": next tokens})``: softmax
  cross-entropy per token, averaged over batch and time."""
  def loss_fn(params, batch):
    out = charlm_logits(params, batch["x"], heads)
    return kfl.softmax_cross_entropy_with_integer_labels(out, batch["y"]).mean()
  return loss_fn


def charlm_muon_dims(params):
  """Muon on the blocks' matrices; None (AdamW) on everything else."""
  dims = optax.contrib.MuonDimensionNumbers
  out = jax.tree.map(lambda _: None, params)
  for name in params:
    if name.startswith("block"):
      for layer in ("qkv", "proj", "fc", "out"):
        out[name][layer]["w"] = dims(reduction_axis=0, output_axis=1)
  return out
