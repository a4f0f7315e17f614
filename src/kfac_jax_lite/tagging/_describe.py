"""``describe``: the blocks of a model as a list of rows that prints as a table."""
from __future__ import annotations

from kfac_jax_lite.tagging import _blocks


class Row(dict):
  """One block: ``name``, ``kind``, ``block``, ``params``, ``factors``
  (factor shapes), ``bytes`` (state bytes), ``uses``, ``stack``, ``notes``
  (the fallback reason for fallbacks). Fields read as keys or attributes."""

  __getattr__ = dict.__getitem__


class Table(list):
  """A list of ``Row``s whose ``str`` is an aligned text table."""

  COLUMNS = ("name", "kind", "block", "params", "factors", "bytes", "uses",
             "notes")

  def __str__(self):
    def cell(row, c):
      v = row[c]
      if c == "params":
        return ", ".join(v)
      if c == "factors":
        return " ⊗ ".join("x".join(map(str, s)) for s in v) or "-"
      if c == "block" and row["stack"]:
        return f"{v}[×{row['stack']}]"
      return "" if v is None else str(v)
    cells = [[cell(r, c) for c in self.COLUMNS] for r in self]
    widths = [max([len(c)] + [len(r[i]) for r in cells])
              for i, c in enumerate(self.COLUMNS)]
    line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()
    out = [line(self.COLUMNS), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    total = self.total_bytes
    out.append(f"{len(self)} blocks, {total} bytes of state "
               f"({total / 2**20:.1f} MiB)")
    return "\n".join(out)

  @property
  def total_bytes(self):
    """Bytes of the curvature state of all blocks (the total line)."""
    return sum(r["bytes"] for r in self)

  __repr__ = __str__


def rows(tagged):
  table = Table()
  for l in tagged.layers:
    table.append(Row(
        name=l.name, kind=l.kind, block=type(l.block).__name__,
        params=tuple(l.params), factors=_blocks.factor_shapes(l.block),
        bytes=_blocks.state_bytes(l.block, l.stack), uses=l.uses,
        stack=l.stack, notes=l.reason or l.notes))
  return table


def describe(loss_fn, params, batch, **kwargs):
  """The curvature blocks ``find_layers`` builds for ``loss_fn``, as rows.

  Keyword arguments are those of ``find_layers`` (``has_aux``, ``blocks``,
  ``exclude``, ...). Prints as a table; fallbacks carry their reason."""
  from kfac_jax_lite.tagging._tagged import find_layers
  return rows(find_layers(loss_fn, params, batch, **kwargs))
