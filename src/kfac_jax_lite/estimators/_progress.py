"""A progress bar over a stream of batches, for the fits that stream them
(``kfl.laplace.fit``, ``kfl.influence``): tqdm's when it is installed and
``enabled`` (and not in a log: ``disable=None``), else the batches as they
are."""
from __future__ import annotations


def progress(iterable, enabled, desc):
  """``iterable`` under a tqdm bar labelled ``desc`` (``"batch"`` units,
  not left on screen), or ``iterable`` itself when not ``enabled`` or
  without tqdm."""
  if not enabled:
    return iterable
  try:
    from tqdm.auto import tqdm
  except ImportError:
    return iterable
  return tqdm(iterable, desc=desc, unit="batch", disable=None, leave=False)
