"""Tiny models in each framework for the tagging tests.

Each factory returns ``(loss_fn, params, batch)``; ``loss_fn`` is a mean
over examples of a per-example loss, so ``loss_fn`` on a batch of one is
that example's loss.
"""
import jax
import jax.numpy as jnp
from jax import lax

N = 3
K = jax.random.key(0)


def _keys(n):
  return jax.random.split(K, n)


def _w(k, *shape):
  return jax.random.normal(k, shape) / jnp.sqrt(shape[0])


def _mse(y):
  return 0.5 * jnp.mean(jnp.sum(y.reshape(y.shape[0], -1) ** 2, -1))


def _xent(logits, labels):
  lp = jax.nn.log_softmax(logits)
  return -jnp.mean(jnp.take_along_axis(lp, labels[:, None], -1))


# ------------------------------------------------------------- plain JAX
def jax_mlp(bias=True):
  k = _keys(4)
  p = {"l1": {"w": _w(k[0], 4, 5)}, "l2": {"w": _w(k[1], 3, 5)}}  # l2: x @ W.T
  if bias:
    p["l1"]["b"] = 0.1 * jnp.ones(5)
    p["l2"]["b"] = 0.1 * jnp.ones(3)

  def loss(p, batch):
    x, y = batch
    h = x @ p["l1"]["w"] + p["l1"].get("b", 0.0)
    h = jnp.tanh(h)
    out = h @ p["l2"]["w"].T
    if "b" in p["l2"]:
      out = out + p["l2"]["b"]
    return _mse(out - y)
  batch = (jax.random.normal(k[2], (N, 4)), jax.random.normal(k[3], (N, 3)))
  return loss, p, batch


def jax_cnn():
  k = _keys(6)
  p = {"c1": _w(k[0], 3, 2, 4), "c1b": jnp.ones(4) * 0.1,       # 1-D, WIO
       "c2": _w(k[1], 4, 1, 3, 3),                               # depthwise OIHW
       "c3": _w(k[2], 3, 3, 4, 2),                               # strided/dilated HWIO
       "dense": _w(k[3], 2, 3)}

  def loss(p, batch):
    x1, x2 = batch                                   # [N, 6, 2], [N, 4, 7, 7]
    h1 = lax.conv_general_dilated(x1, p["c1"], (1,), "SAME",
                                  dimension_numbers=("NWC", "WIO", "NWC"))
    h1 = jax.nn.relu(h1 + p["c1b"])
    h2 = lax.conv_general_dilated(x2, p["c2"], (1, 1), ((1, 1), (1, 1)),
                                  feature_group_count=4)  # NCHW / OIHW
    h2 = jnp.tanh(h2).transpose(0, 2, 3, 1)           # NHWC
    h3 = lax.conv_general_dilated(h2, p["c3"], (2, 2), "VALID",
                                  rhs_dilation=(2, 1),
                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))
    feat = h3.mean((1, 2)) + h1.mean(1)[:, :2]
    return _mse(feat @ p["dense"])
  batch = (jax.random.normal(k[4], (N, 6, 2)), jax.random.normal(k[5], (N, 4, 7, 7)))
  return loss, p, batch


def jax_text():
  k = _keys(4)
  p = {"embed": _w(k[0], 7, 4), "head": {"w": _w(k[1], 4, 3), "b": jnp.zeros(3)}}

  def loss(p, batch):
    ids, labels = batch
    e = jnp.take(p["embed"], ids, axis=0).mean(1)
    return _xent(e @ p["head"]["w"] + p["head"]["b"], labels)
  batch = (jax.random.randint(k[2], (N, 5), 0, 7), jax.random.randint(k[3], (N,), 0, 3))
  return loss, p, batch


def _layer_norm(x, scale, bias):
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) * lax.rsqrt(var + 1e-5) * scale + bias


def jax_transformer():
  d, v, t = 4, 6, 3
  k = _keys(9)
  p = {"embed": _w(k[0], v, d), "pos": 0.1 * _w(k[1], t, d),
       "ln1": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
       "q": _w(k[2], d, d), "k": _w(k[3], d, d), "v": _w(k[4], d, d),
       "o": _w(k[5], d, d),
       "ln2": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
       "mlp1": {"w": _w(k[6], d, 8), "b": jnp.zeros(8)},
       "mlp2": {"w": _w(k[7], 8, d), "b": jnp.zeros(d)}}

  def loss(p, batch):
    ids, targets = batch                       # [N, T] each
    x = p["embed"][ids] + p["pos"]
    h = _layer_norm(x, p["ln1"]["scale"], p["ln1"]["bias"])
    q = jnp.einsum("ntd,de->nte", h, p["q"])
    kk, vv = h @ p["k"], h @ p["v"]
    att = jax.nn.softmax(jnp.einsum("nsd,ntd->nst", q, kk) / 2.0, -1)
    x = x + jnp.einsum("nst,ntd->nsd", att, vv) @ p["o"]
    h = _layer_norm(x, p["ln2"]["scale"], p["ln2"]["bias"])
    x = x + (jax.nn.gelu(h @ p["mlp1"]["w"] + p["mlp1"]["b"]) @ p["mlp2"]["w"] + p["mlp2"]["b"])
    logits = x @ p["embed"].T                  # tied output embedding
    lp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.sum(jnp.take_along_axis(lp, targets[..., None], -1), (1, 2)))
  batch = (jax.random.randint(k[8], (N, t), 0, v), jax.random.randint(k[0], (N, t), 0, v))
  return loss, p, batch


def jax_scan():
  """Stacked layers under scan, a cell reused at every step, an inner jit
  and a checkpointed block."""
  k = _keys(6)
  p = {"stack": {"w": _w(k[0], 3, 4, 4), "b": 0.1 * jnp.ones((3, 4))},
       "cell": _w(k[1], 4, 4), "inp": _w(k[2], 2, 4),
       "head": _w(k[3], 4, 2), "scale": jnp.ones(4)}

  def loss(p, batch):
    xs, y = batch                                 # [N, T, 2], [N, 2]
    @jax.jit
    def embed(w, x):
      return x @ w
    def rnn(h, x_t):
      h = jnp.tanh(h @ p["cell"] + embed(p["inp"], x_t))
      return h, None
    h, _ = lax.scan(rnn, jnp.zeros((xs.shape[0], 4)), jnp.swapaxes(xs, 0, 1))
    def layer(h, wb):
      return jax.nn.relu(h @ wb["w"] + wb["b"]), None
    h, _ = lax.scan(layer, h, p["stack"])
    h = jax.checkpoint(lambda h, s: h * s)(h, p["scale"])
    return _mse(h @ p["head"] - y)
  batch = (jax.random.normal(k[4], (N, 3, 2)), jax.random.normal(k[5], (N, 2)))
  return loss, p, batch


def jax_cond():
  k = _keys(4)
  p = {"a": _w(k[0], 3, 3), "b": _w(k[1], 3, 3)}

  def loss(p, batch):
    x = batch
    h = lax.cond(x.sum() > -100, lambda x: jnp.tanh(x @ p["a"]), lambda x: x, x)
    return _mse(h @ p["b"])
  return loss, p, jax.random.normal(k[2], (N, 3))


# ------------------------------------------------------------ Flax linen
def linen_mlp():
  import flax.linen as nn

  class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.relu(nn.Dense(5)(x))
      x = nn.LayerNorm()(x)
      return nn.Dense(2, use_bias=False)(x)
  m = MLP()
  k = _keys(3)
  x, y = jax.random.normal(k[0], (N, 3)), jax.random.normal(k[1], (N, 2))
  params = m.init(k[2], x)
  return (lambda p, b: _mse(m.apply(p, b[0]) - b[1])), params, (x, y)


def linen_cnn():
  import flax.linen as nn

  class CNN(nn.Module):
    @nn.compact
    def __call__(self, x1, x2):
      h1 = nn.Conv(3, (3,))(x1).mean(1)                                 # 1-D
      h2 = nn.Conv(4, (3, 3), strides=2, kernel_dilation=1)(x2)         # 2-D strided
      h2 = nn.Conv(4, (3, 3), feature_group_count=4, padding="SAME",
                   kernel_dilation=2)(jnp.tanh(h2))                     # depthwise, dilated
      return nn.Dense(2)(jnp.concatenate([h1, h2.mean((1, 2))], -1))
  m = CNN()
  k = _keys(3)
  x1, x2 = jax.random.normal(k[0], (N, 5, 2)), jax.random.normal(k[1], (N, 6, 6, 2))
  params = m.init(k[2], x1, x2)
  return (lambda p, b: _mse(m.apply(p, b[0], b[1]))), params, (x1, x2)


def linen_transformer():
  import flax.linen as nn

  class Block(nn.Module):
    @nn.compact
    def __call__(self, ids):
      emb = nn.Embed(6, 4)
      x = emb(ids)
      h = nn.LayerNorm()(x)
      x = x + nn.SelfAttention(num_heads=1, qkv_features=4, out_features=4,
                               deterministic=True)(h)
      h = nn.LayerNorm()(x)
      x = x + nn.Dense(4)(nn.gelu(nn.Dense(8)(h)))
      return emb.attend(x)
  m = Block()
  k = _keys(2)
  ids = jax.random.randint(k[0], (N, 3), 0, 6)
  params = m.init(k[1], ids)
  return (lambda p, b: _xent(m.apply(p, b).reshape(-1, 6), b.reshape(-1)) * 3), params, ids


def linen_scan():
  import flax.linen as nn

  class Cell(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return jnp.tanh(nn.Dense(4)(h)), None

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      Stack = nn.scan(Cell, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=3)
      h, _ = Stack()(x, None)
      return nn.Dense(2)(h)
  m = Model()
  k = _keys(2)
  x = jax.random.normal(k[0], (N, 4))
  params = m.init(k[1], x)
  return (lambda p, b: _mse(m.apply(p, b))), params, x


# ------------------------------------------------------------- Flax nnx
def nnx_mlp():
  from flax import nnx

  class MLP(nnx.Module):
    def __init__(self, rngs):
      self.l1 = nnx.Linear(3, 5, rngs=rngs)
      self.norm = nnx.RMSNorm(5, rngs=rngs)
      self.l2 = nnx.Linear(5, 2, rngs=rngs)

    def __call__(self, x):
      return self.l2(self.norm(jax.nn.relu(self.l1(x))))
  model = MLP(nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  params = nnx.to_pure_dict(params)

  def loss(p, b):
    state = nnx.state(nnx.merge(graphdef, nnx.State({})) if False else model, nnx.Param)
    nnx.replace_by_pure_dict(state, p)
    return _mse(nnx.merge(graphdef, state)(b))
  k = _keys(1)
  return loss, params, jax.random.normal(k[0], (N, 3))


# --------------------------------------------------------------- Haiku
def haiku_mlp():
  import haiku as hk

  def f(x):
    return hk.nets.MLP([5, 2])(x)
  t = hk.without_apply_rng(hk.transform(f))
  k = _keys(3)
  x, y = jax.random.normal(k[0], (N, 3)), jax.random.normal(k[1], (N, 2))
  params = t.init(k[2], x)
  return (lambda p, b: _mse(t.apply(p, b[0]) - b[1])), params, (x, y)


def haiku_text():
  import haiku as hk

  def f(ids):
    e = hk.Embed(7, 4)(ids)
    e = hk.LayerNorm(-1, True, True)(e).mean(1)
    return hk.Linear(3)(e)
  t = hk.without_apply_rng(hk.transform(f))
  k = _keys(3)
  ids = jax.random.randint(k[0], (N, 5), 0, 7)
  labels = jax.random.randint(k[1], (N,), 0, 3)
  params = t.init(k[2], ids)
  return (lambda p, b: _xent(t.apply(p, b[0]), b[1])), params, (ids, labels)


# ------------------------------------------------------------- Equinox
def eqx_mlp():
  import equinox as eqx
  k = _keys(3)
  model = eqx.nn.MLP(3, 2, 5, depth=2, key=k[0])
  params, static = eqx.partition(model, eqx.is_array)

  def loss(p, b):
    m = eqx.combine(p, static)
    return _mse(jax.vmap(m)(b[0]) - b[1])
  x, y = jax.random.normal(k[1], (N, 3)), jax.random.normal(k[2], (N, 2))
  return loss, params, (x, y)


def eqx_cnn():
  import equinox as eqx
  k = _keys(5)
  model = (eqx.nn.Conv2d(2, 3, 3, stride=2, key=k[0]),
           eqx.nn.Conv1d(2, 3, 3, dilation=2, key=k[1]),
           eqx.nn.Embedding(5, 3, key=k[2]), eqx.nn.LayerNorm(3),
           eqx.nn.Linear(3, 2, key=k[3]))
  params, static = eqx.partition(model, eqx.is_array)

  def one(m, x2, x1, i):
    c2, c1, emb, ln, lin = m
    h = c2(x2).mean((1, 2)) + c1(x1).mean(1) + emb(i)
    return lin(jnp.tanh(ln(h)))

  def loss(p, b):
    m = eqx.combine(p, static)
    return _mse(jax.vmap(one, (None, 0, 0, 0))(m, *b))
  kk = jax.random.split(k[4], 3)
  batch = (jax.random.normal(kk[0], (N, 2, 5, 5)), jax.random.normal(kk[1], (N, 2, 7)),
           jax.random.randint(kk[2], (N,), 0, 5))
  return loss, params, batch


# ------------------------------------------------- GPT-style decoders
# One layer of a causal decoder as people write it in each framework:
# token + learned position embeddings (looked up with ``arange``),
# pre-LayerNorm, causal multi-head attention with a fused QKV kernel, a
# GELU MLP, and a tied (nnx, Equinox, plain JAX) or untied (linen, Haiku)
# output head. A tiny char task: each token is followed by the next one
# (mod V). Each factory returns ``(loss_fn, params, batch)``; the loss is
# ``kfl.softmax_cross_entropy_with_integer_labels`` (a registered loss).
GPT_V, GPT_T, GPT_D, GPT_H, GPT_N = 20, 8, 16, 2, 8


def gpt_batch(n=GPT_N, seed=1):
  k = jax.random.split(jax.random.key(seed), 2)
  start = jax.random.randint(k[0], (n, 1), 0, GPT_V)
  step = jax.random.randint(k[1], (n, 1), 1, 3)
  seq = (start + step * jnp.arange(GPT_T + 1)) % GPT_V
  return seq[:, :-1], seq[:, 1:]


def _causal(qkv, heads=GPT_H):
  """Causal multi-head attention of a fused ``qkv [..., T, 3D]``."""
  q, k, v = jnp.split(qkv, 3, -1)
  split = lambda x: x.reshape(x.shape[:-1] + (heads, -1))
  q, k, v = split(q), split(k), split(v)
  t = q.shape[-3]
  att = jnp.einsum("...thd,...shd->...hts", q, k) / jnp.sqrt(q.shape[-1])
  att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
  out = jnp.einsum("...hts,...shd->...thd", jax.nn.softmax(att, -1), v)
  return out.reshape(out.shape[:-2] + (-1,))


def _gpt_xent(logits, targets):
  import kfac_jax_lite as kfl
  return kfl.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def gpt_jax():
  """Plain JAX: the fused kernel split with ``jnp.split(W, 3, -1)`` (and
  its bias), weight decay in the loss, the output tied to the embedding."""
  d, k = GPT_D, _keys(6)
  ln = lambda: {"scale": jnp.ones(d), "bias": jnp.zeros(d)}
  p = {"wte": 0.1 * _w(k[0], GPT_V, d), "wpe": 0.1 * _w(k[1], GPT_T, d),
       "ln1": ln(), "ln2": ln(), "lnf": ln(),
       "qkv": {"w": _w(k[2], d, 3 * d), "b": jnp.zeros(3 * d)},
       "proj": {"w": _w(k[3], d, d), "b": jnp.zeros(d)},
       "fc": {"w": _w(k[4], d, 4 * d), "b": jnp.zeros(4 * d)},
       "out": {"w": _w(k[5], 4 * d, d), "b": jnp.zeros(d)}}

  def loss(p, batch):
    ids, targets = batch
    x = p["wte"][ids] + p["wpe"][jnp.arange(ids.shape[1])]
    h = _layer_norm(x, **p["ln1"])
    ws, bs = jnp.split(p["qkv"]["w"], 3, -1), jnp.split(p["qkv"]["b"], 3)
    qkv = jnp.concatenate([h @ w + b for w, b in zip(ws, bs)], -1)
    x = x + _causal(qkv) @ p["proj"]["w"] + p["proj"]["b"]
    h = _layer_norm(x, **p["ln2"])
    h = jax.nn.gelu(h @ p["fc"]["w"] + p["fc"]["b"])
    x = x + h @ p["out"]["w"] + p["out"]["b"]
    logits = _layer_norm(x, **p["lnf"]) @ p["wte"].T
    decay = sum(jnp.sum(p[n]["w"] ** 2) for n in ("qkv", "proj", "fc", "out"))
    return _gpt_xent(logits, targets) + 1e-4 * decay
  return loss, p, gpt_batch()


def gpt_nnx():
  from flax import nnx
  d = GPT_D

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
      self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
      self.proj = nnx.Linear(d, d, rngs=rngs)
      self.fc, self.out = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x):
      x = x + self.proj(_causal(self.qkv(self.ln1(x))))
      return x + self.out(nnx.gelu(self.fc(self.ln2(x))))

  class GPT(nnx.Module):
    def __init__(self, rngs):
      self.wte = nnx.Embed(GPT_V, d, rngs=rngs)
      self.wpe = nnx.Embed(GPT_T, d, rngs=rngs)
      self.block = Block(rngs)
      self.lnf = nnx.LayerNorm(d, rngs=rngs)

    def __call__(self, ids):
      x = self.wte(ids) + self.wpe(jnp.arange(ids.shape[1]))
      return self.wte.attend(self.lnf(self.block(x)))   # tied head
  graphdef, state = nnx.split(GPT(nnx.Rngs(0)))
  params = nnx.to_pure_dict(state)

  def loss(p, batch):
    st = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(st, p)
    return _gpt_xent(nnx.merge(graphdef, st)(batch[0]), batch[1])
  return loss, params, gpt_batch()


def gpt_linen():
  import flax.linen as nn
  d = GPT_D

  class GPT(nn.Module):
    @nn.compact
    def __call__(self, ids):
      x = nn.Embed(GPT_V, d)(ids) + nn.Embed(GPT_T, d)(jnp.arange(ids.shape[1]))
      x = x + nn.Dense(d, name="proj")(_causal(nn.Dense(3 * d, name="qkv")(
          nn.LayerNorm()(x))))
      h = nn.gelu(nn.Dense(4 * d, name="fc")(nn.LayerNorm()(x)))
      x = x + nn.Dense(d, name="out")(h)
      return nn.Dense(GPT_V, use_bias=False, name="head")(nn.LayerNorm()(x))
  m = GPT()
  ids, targets = gpt_batch()
  params = m.init(jax.random.key(0), ids)
  return (lambda p, b: _gpt_xent(m.apply(p, b[0]), b[1])), params, (ids, targets)


def gpt_eqx():
  import equinox as eqx
  d, k = GPT_D, _keys(6)

  class GPT(eqx.Module):
    wte: eqx.nn.Embedding
    wpe: eqx.nn.Embedding
    ln1: eqx.nn.LayerNorm
    ln2: eqx.nn.LayerNorm
    lnf: eqx.nn.LayerNorm
    qkv: eqx.nn.Linear
    proj: eqx.nn.Linear
    fc: eqx.nn.Linear
    out: eqx.nn.Linear

    def __call__(self, ids):   # One sequence [T].
      tok = lambda f, x: jax.vmap(f)(x)
      x = tok(self.wte, ids) + tok(self.wpe, jnp.arange(ids.shape[0]))
      x = x + tok(self.proj, _causal(tok(self.qkv, tok(self.ln1, x))))
      x = x + tok(self.out, jax.nn.gelu(tok(self.fc, tok(self.ln2, x))))
      return tok(self.lnf, x) @ self.wte.weight.T   # tied head
  model = GPT(eqx.nn.Embedding(GPT_V, d, key=k[0]),
              eqx.nn.Embedding(GPT_T, d, key=k[1]), eqx.nn.LayerNorm(d),
              eqx.nn.LayerNorm(d), eqx.nn.LayerNorm(d),
              eqx.nn.Linear(d, 3 * d, key=k[2]), eqx.nn.Linear(d, d, key=k[3]),
              eqx.nn.Linear(d, 4 * d, key=k[4]), eqx.nn.Linear(4 * d, d, key=k[5]))
  params, static = eqx.partition(model, eqx.is_array)

  def loss(p, batch):
    m = eqx.combine(p, static)
    return _gpt_xent(jax.vmap(m)(batch[0]), batch[1])
  return loss, params, gpt_batch()


def gpt_haiku():
  import haiku as hk
  d = GPT_D

  def f(ids):
    t = ids.shape[1]
    pos = hk.get_parameter("pos", [GPT_T, d], init=hk.initializers.TruncatedNormal(0.02))
    x = hk.Embed(GPT_V, d)(ids) + pos[:t]
    ln = lambda: hk.LayerNorm(-1, True, True)
    x = x + hk.Linear(d, name="proj")(_causal(hk.Linear(3 * d, name="qkv")(ln()(x))))
    x = x + hk.Linear(d, name="out")(jax.nn.gelu(hk.Linear(4 * d, name="fc")(ln()(x))))
    return hk.Linear(GPT_V, with_bias=False, name="head")(ln()(x))
  t = hk.without_apply_rng(hk.transform(f))
  ids, targets = gpt_batch()
  params = t.init(jax.random.key(0), ids)
  return (lambda p, b: _gpt_xent(t.apply(p, b[0]), b[1])), params, (ids, targets)


# ------------------------------------------- rows that are not examples
# A graph network as jraph models are written: an embedding of node types,
# an edge layer on sender and receiver features, messages summed per
# receiving node and a node layer, pooled per graph with
# ``jax.ops.segment_sum``. Four graphs (3, 2, 1 and 3 nodes; the third
# has no edges, the fourth is masked out of the loss) and a padding node
# of no graph (segment id 4, dropped). ``eps``: perturbations added to
# the layer outputs (the tests' Jacobians); the loss takes none.
GNN_G, GNN_F, GNN_H, GNN_C, GNN_TYPES = 4, 3, 4, 3, 4


def gnn(dtype=jnp.float32):
  k = _keys(5)
  f, h = GNN_F, GNN_H
  p = {"type": _w(k[0], GNN_TYPES, f).astype(dtype),
       "edge": {"w": _w(k[1], 2 * f, h).astype(dtype),
                "b": 0.1 * jnp.ones(h, dtype)},
       "node": {"w": _w(k[2], f + h, h).astype(dtype),
                "b": 0.1 * jnp.ones(h, dtype)},
       "read": {"w": _w(k[3], h, GNN_C).astype(dtype),
                "b": jnp.zeros(GNN_C, dtype)}}
  senders = jnp.array([0, 1, 2, 0, 3, 4, 6, 7, 8])
  receivers = jnp.array([1, 2, 0, 2, 4, 3, 7, 8, 6])
  batch = {"nodes": jax.random.normal(k[4], (10, f), dtype),
           "types": jnp.array([0, 1, 2, 3, 0, 1, 2, 3, 0, 1]),
           "senders": senders, "receivers": receivers,
           "node_graph": jnp.array([0, 0, 0, 1, 1, 2, 3, 3, 3, 4]),
           "y": jnp.array([0, 2, 1, 1]),
           "mask": jnp.array([1.0, 1.0, 1.0, 0.0], dtype)}

  def loss(p, b):
    import kfac_jax_lite as kfl
    ce = kfl.softmax_cross_entropy_with_integer_labels(gnn_logits(p, b), b["y"])
    return jnp.sum(ce * b["mask"]) / jnp.sum(b["mask"])
  return loss, p, batch


def gnn_inputs(p, b, eps=None):
  """The layers' inputs: ``{"edge", "node": [rows, in], "type": ids}``
  (and the logits under ``"logits"``)."""
  eps = eps or {}
  x = p["type"][b["types"]] + eps.get("type", 0)
  x = b["nodes"] + x
  e_in = jnp.concatenate([x[b["senders"]], x[b["receivers"]]], -1)
  m = jnp.tanh(e_in @ p["edge"]["w"] + p["edge"]["b"] + eps.get("edge", 0))
  agg = jax.ops.segment_sum(m, b["receivers"], num_segments=x.shape[0])
  n_in = jnp.concatenate([x, agg], -1)
  hn = jnp.tanh(n_in @ p["node"]["w"] + p["node"]["b"] + eps.get("node", 0))
  g = jax.ops.segment_sum(hn, b["node_graph"], num_segments=GNN_G)
  return {"edge": e_in, "node": n_in, "type": b["types"],
          "logits": g @ p["read"]["w"] + p["read"]["b"]}


def gnn_logits(p, b, eps=None):
  return gnn_inputs(p, b, eps)["logits"]


def gnn_eps(p, b):
  dt = p["edge"]["w"].dtype
  return {"edge": jnp.zeros((b["senders"].shape[0], GNN_H), dt),
          "node": jnp.zeros((b["nodes"].shape[0], GNN_H), dt),
          "type": jnp.zeros((b["nodes"].shape[0], GNN_F), dt)}


# A position table looked up with one row for the whole batch
# (``jnp.arange(T)[None]``, form "none") or broadcast to it
# (``jnp.broadcast_to``); a causal running mean mixes the positions.
POS_V, POS_T, POS_D, POS_N = 5, 3, 4, 3


def pos_logits(p, ids, eps=0, form="none"):
  t = ids.shape[1]
  pos = (jnp.arange(t)[None] if form == "none"
         else jnp.broadcast_to(jnp.arange(t), ids.shape))
  x = p["wte"][ids] + p["wpe"][pos] + eps
  h = jnp.tanh(jnp.cumsum(x, 1) / jnp.arange(1, t + 1)[:, None])
  return h @ p["head"]


def pos_lookup(form, dtype=jnp.float32):
  k = _keys(4)
  p = {"wte": _w(k[0], POS_V, POS_D).astype(dtype),
       "wpe": _w(k[1], POS_T, POS_D).astype(dtype),
       "head": _w(k[2], POS_D, POS_V).astype(dtype)}
  ids = jax.random.randint(k[3], (POS_N, POS_T), 0, POS_V)

  def loss(p, b):
    import kfac_jax_lite as kfl
    return kfl.softmax_cross_entropy_with_integer_labels(
        pos_logits(p, b[0], form=form), b[1]).mean()
  return loss, p, (ids, (ids + 1) % POS_V)
