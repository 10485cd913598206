"""The skip list: sample ids that set off a detection, kept across restarts.

A detection names the ids of the rows of a batch that held non-finite values; when the batch is
at fault, rank 0 appends them to the job's skip list (``nansentinel.rare.samples`` writes it).
On resume, a loader leaves them out::

    from nansentinel import skip_list
    skip = skip_list.load()                                  # the job's ids (a set)
    sampler = skip_list.SkipSampler(DistributedSampler(dataset), skip)

(or :func:`without` for an iterable dataset, with a ``key`` that reads a sample's id).
"""

from nansentinel.rare.samples import (
    MAX_IDS,
    MAX_STRETCH_IDS,
    SampleId,
    SkipSampler,
    append,
    as_ids,
    check_ids,
    default_path,
    load,
    nonfinite_rows,
    path_from_env,
    without,
)

__all__ = [
    "MAX_IDS",
    "MAX_STRETCH_IDS",
    "SampleId",
    "SkipSampler",
    "append",
    "as_ids",
    "check_ids",
    "default_path",
    "load",
    "nonfinite_rows",
    "path_from_env",
    "without",
]
