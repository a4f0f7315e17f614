"""The collectives of a compiled XLA program, read from its HLO text.

``collectives(compiled.as_text())`` lists every collective instruction of
the (SPMD-partitioned, per-device) program: its kind, the bytes of its
result and the size of its replica group, and whether it runs on every
step or only inside a branch of a ``conditional`` (``lax.cond``/
``lax.switch``). ``summarize`` adds them up per kind and estimates the
bytes each device sends on a ring.

What counts:

* **kinds**: ``all-reduce``, ``reduce-scatter``, ``all-gather``,
  ``collective-permute`` and ``all-to-all``. An asynchronous pair
  (``all-reduce-start``/``all-reduce-done``, ...) counts once, at its
  ``-done``, whose result is the collective's output (a ``-start``'s result
  is a tuple that also holds the operand).
* **bytes**: the instruction's result shape(s), a tuple's elements summed,
  times the element size. For a reduce-scatter that is the output (one
  shard); its input is ``group`` times larger.
* **group**: the size of the first replica group (``{{0,1,2,3},...}`` or
  the iota form ``[2,4]<=[8]``); an empty ``{}`` means all the program's
  ``num_partitions`` (or ``replicas``); a collective-permute has none
  (``None``).
* **conditional**: the instruction sits in a computation reachable from
  the entry computation only through a ``conditional``'s branch
  (``branch_computations={...}`` or ``true_computation=``/
  ``false_computation=``), anything those branches call included. The
  rest are "every step". A collective inside a ``while`` body counts once,
  not once per iteration (``while`` appears in ``Collective.loops``).

Pure functions over the text: no JAX needed (``tests/test_hlo_collectives.py``).
"""
from __future__ import annotations

import re
from typing import NamedTuple

KINDS = ("all-reduce", "reduce-scatter", "all-gather", "collective-permute",
         "all-to-all")

ELEMENT_BYTES = {
    "pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1,
    "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "f8e4m3b11fnuz": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 1,
    "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
}

# Attributes whose value names called computations.
_CALL_ATTRS = ("calls", "to_apply", "body", "condition", "true_computation",
               "false_computation", "branch_computations",
               "called_computations", "select", "scatter", "comparator")
_BRANCH_ATTRS = ("true_computation", "false_computation",
                 "branch_computations")
_CALL_RE = re.compile(r"\b(" + "|".join(_CALL_ATTRS) +
                      r")=(\{[^}]*\}|%?[\w.\-]+)")
_INSTR_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>.*?)\s+"
    r"(?P<op>[a-z][a-z0-9\-]*)\(")
_SHAPE_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_GROUPS_RE = re.compile(r"replica_groups=(\{(?:\{[0-9,\s]*\},?\s*)*\}|"
                        r"\[[0-9,]+\]<=\[[0-9,]+\][^,\s]*)")
_PARTITIONS_RE = re.compile(r"\bnum_partitions=(\d+)")
_REPLICAS_RE = re.compile(r"\breplica_count=(\d+)")
# Attributes with free text inside braces, dropped before parsing.
_NOISE_RE = re.compile(r",\s*(?:metadata|backend_config|frontend_attributes|"
                       r"statistics)=(\{(?:[^{}]|\{[^{}]*\})*\}|\"(?:[^\"\\]|"
                       r"\\.)*\")")


class Collective(NamedTuple):
  kind: str  # One of KINDS.
  name: str  # The instruction's name.
  computation: str  # The computation it sits in.
  nbytes: int  # Its result's bytes (all tuple elements).
  group: int | None  # Devices in its replica group; None: a permute.
  conditional: bool  # Only inside a conditional's branch.
  loops: bool  # Inside a while body (counted once).


def shape_bytes(type_text: str) -> int:
  """Bytes of an HLO type: ``f32[8,16]{1,0}``, ``(f32[2], s32[])``, ...
  (``token[]`` and unknown element types count 0)."""
  total = 0
  for dtype, dims in _SHAPE_RE.findall(type_text):
    size = ELEMENT_BYTES.get(dtype)
    if size is None:
      continue
    n = 1
    for d in dims.split(","):
      if d:
        n *= int(d)
    total += n * size
  return total


def _group_size(text: str, default: int | None) -> int | None:
  m = _GROUPS_RE.search(text)
  if not m:
    return default
  groups = m.group(1)
  if groups.startswith("["):  # Iota form [n_groups,size]<=[...]
    dims = [int(d) for d in groups[1:groups.index("]")].split(",")]
    return dims[-1]
  first = re.search(r"\{([0-9,\s]*)\}", groups[1:])
  if first is None or not first.group(1).strip():
    return default
  return len([d for d in first.group(1).split(",") if d.strip()])


def parse_computations(hlo_text: str):
  """``(entry name, {computation name: [instruction lines]})``."""
  comps, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    stripped = line.strip()
    if current is None:
      if stripped.endswith("{") and "->" in stripped and not line[:1].isspace():
        head = stripped
        is_entry = head.startswith("ENTRY ")
        if is_entry:
          head = head[len("ENTRY "):]
        name = head.split("(", 1)[0].strip().lstrip("%").strip()
        current = name
        comps[name] = []
        if is_entry:
          entry = name
      continue
    if stripped == "}":
      current = None
    elif stripped:
      comps[current].append(_NOISE_RE.sub("", stripped))
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text")
  return entry, comps


def _calls(line: str):
  """``[(attribute, computation name)]`` that the instruction calls."""
  out = []
  for attr, value in _CALL_RE.findall(line):
    names = value.strip("{}").split(",")
    out.extend((attr, n.strip().lstrip("%")) for n in names if n.strip())
  return out


def collectives(hlo_text: str, num_devices: int | None = None):
  """Every collective instruction of the program (module docstring).

  ``num_devices``: the group of a collective with ``replica_groups={}``
  (default: the module's ``num_partitions``, else ``replica_count``).
  """
  m = _PARTITIONS_RE.search(hlo_text) or _REPLICAS_RE.search(hlo_text)
  default = num_devices or (int(m.group(1)) if m else None)
  entry, comps = parse_computations(hlo_text)

  # Reachability: (computation, under a branch, under a loop) states.
  every, cond, loop = set(), set(), set()
  stack = [(entry, False, False)]
  seen = set()
  while stack:
    comp, in_branch, in_loop = stack.pop()
    if (comp, in_branch, in_loop) in seen or comp not in comps:
      continue
    seen.add((comp, in_branch, in_loop))
    (cond if in_branch else every).add(comp)
    if in_loop:
      loop.add(comp)
    for line in comps[comp]:
      for attr, callee in _calls(line):
        stack.append((callee, in_branch or attr in _BRANCH_ATTRS,
                      in_loop or attr == "body" or attr == "condition"))

  out = []
  for comp, lines in comps.items():
    if comp not in every and comp not in cond:
      continue  # Unreachable (dead) computation.
    for line in lines:
      m = _INSTR_RE.match(line)
      if not m:
        continue
      op = m.group("op")
      kind = op[:-len("-done")] if op.endswith("-done") else op
      if kind not in KINDS:
        continue  # Not a collective, or a "-start" (counted at its done).
      if op.endswith("-done"):
        # The start's attributes (groups) are on the start instruction.
        group = _start_group(lines, line, kind, default)
      else:
        group = None if kind == "collective-permute" else _group_size(
            line, default)
      out.append(Collective(kind, m.group("name"), comp,
                            shape_bytes(m.group("type")), group,
                            comp not in every, comp in loop))
  return out


def _start_group(lines, done_line, kind, default):
  if kind == "collective-permute":
    return None
  operand = re.search(r"-done\(\s*(?:[^%)]*\s)?%?([\w.\-]+)\)", done_line)
  if operand:
    for line in lines:
      m = _INSTR_RE.match(line)
      if m and m.group("name") == operand.group(1):
        return _group_size(line, default)
  return default


def ring_bytes(c: Collective) -> float:
  """Bytes one device sends for ``c`` on a ring of ``c.group`` devices:
  all-reduce ``2(g-1)/g·size``, reduce-scatter ``(g-1)/g·input`` (input =
  ``g``·output), all-gather and all-to-all ``(g-1)/g·output``,
  collective-permute its whole buffer."""
  if c.kind == "collective-permute":
    return float(c.nbytes)
  g = c.group or 1
  if c.kind == "all-reduce":
    return 2 * (g - 1) / g * c.nbytes
  if c.kind == "reduce-scatter":
    return (g - 1) / g * (g * c.nbytes)
  return (g - 1) / g * c.nbytes  # all-gather, all-to-all


def summarize(colls):
  """``{kind: {"every": bytes, "cond": bytes, "count_every": n,
  "count_cond": n, "ring_every": bytes, "ring_cond": bytes}}`` over KINDS."""
  out = {k: dict(every=0, cond=0, count_every=0, count_cond=0,
                 ring_every=0.0, ring_cond=0.0) for k in KINDS}
  for c in colls:
    where = "cond" if c.conditional else "every"
    row = out[c.kind]
    row[where] += c.nbytes
    row["count_" + where] += 1
    row["ring_" + where] += ring_bytes(c)
  return out
