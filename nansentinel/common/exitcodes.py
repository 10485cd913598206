"""Exit codes of ``nansentinel run``: what a scheduler or a wrapper script can branch on.

A job script wants to know *why* the launcher stopped without parsing logs: retry a
transient worker crash, page someone on a non-finite abort, drain a node that was excluded,
or fix a typo. Each outcome has one code, the same on every host:

====  =========================  ===========================================================
code  name                       meaning
====  =========================  ===========================================================
0     ``EXIT_OK``                every worker finished successfully
1     ``EXIT_WORKER_FAILED``     a worker failed for a reason the sentinel did not decide
2     ``EXIT_CONFIG``            bad option or configuration; nothing was started
3     ``EXIT_NONFINITE_ABORT``   the sentinel stopped the run on non-finite values
4     ``EXIT_HOST_EXCLUDED``     this host was excluded; its launcher left the job
5     ``EXIT_EXCHANGE_TIMEOUT``  a rank did not answer the health exchange, or the
                                 rendezvous store is gone
6     ``EXIT_NONFINITE_STATE``   the model's own state is non-finite and nothing can repair it
130   ``EXIT_SIGINT``            stopped by SIGINT (Ctrl-C); the workers were stopped
143   ``EXIT_SIGTERM``           stopped by SIGTERM (a scheduler's time limit, ``scancel``)
====  =========================  ===========================================================

A launcher stopped by any other signal it handles exits 128 + its number, as a shell reports
a process killed by it (SIGHUP 129, SIGQUIT 131).

The values are part of the user-facing contract (alerts and job scripts test them); never
renumber them. 2 matches argparse's own usage-error code, so ``--bogus`` and a bad
``--host-strikes`` look the same to a caller.
"""

from __future__ import annotations

EXIT_OK = 0
"""Every worker on this host (and, through torchrun's exit barrier, the job) succeeded."""

EXIT_WORKER_FAILED = 1
"""A worker failed and no sentinel verdict explains it: a Python exception, an OOM kill,
a segfault, a rendezvous that timed out. Usually worth a retry or a look at the logs."""

EXIT_CONFIG = 2
"""A usage or configuration error (unknown option, bad value, missing file). Nothing was
launched; retrying the same command will fail the same way."""

EXIT_NONFINITE_ABORT = 3
"""The sentinel aborted the run because of non-finite values (abort policy, too many
consecutive skips, or a host exclusion with no restart left, or one that leaves fewer hosts
than ``--nnodes``'s minimum: every remaining launcher exits at once, naming the hosts). The
incident report named in the summary says which rank, host, step and kind."""

EXIT_HOST_EXCLUDED = 4
"""This host was excluded (now or by an earlier run, per the exclusion file). Only the
launcher on the excluded host exits with it, after running the ``--on-exclude`` hook, so
that the scheduler can drain the node while the other hosts carry on."""

EXIT_EXCHANGE_TIMEOUT = 5
"""A part of the job stopped answering: a rank did not answer the sentinel's health exchange
within the exchange timeout (a dead, frozen or partitioned rank; the summary names the ranks
that did not answer), or the rendezvous store is gone (its process died or stops answering:
the launchers stop every rank after a common step, and the summary names the store's
address). Either way a restart or a requeue is the answer."""

EXIT_NONFINITE_STATE = 6
"""The model's own state (weights, floating buffers, optimizer state, hyperparameters) holds
a non-finite value that no replica and no snapshot holds finite: a checkpoint restored with a
NaN in it (refused at construction or at ``Sentinel.check_state()``, before any step), or a
state poisoned on every replica mid-run. Unlike 3, lowering the learning rate will not help:
restore another checkpoint. The summary names the tensors, ranks and hosts."""

EXIT_SIGINT = 130
"""SIGINT stopped the launcher (128 + 2): the workers got it too, and SIGKILL after a grace
(nansentinel.launcher.signals). Not a failure of the job: a person or a wrapper stopped it."""

EXIT_SIGTERM = 143
"""SIGTERM stopped the launcher (128 + 15): a scheduler's time limit or cancellation, a
pod's termination. The workers got it too (a checkpoint on SIGTERM has its grace), and the
launcher exits within a bound (see docs/launch.md, "Never hang"). Usually worth a requeue."""

#: Name of each code, for messages and documentation.
NAMES: dict[int, str] = {
    EXIT_OK: "EXIT_OK",
    EXIT_WORKER_FAILED: "EXIT_WORKER_FAILED",
    EXIT_CONFIG: "EXIT_CONFIG",
    EXIT_NONFINITE_ABORT: "EXIT_NONFINITE_ABORT",
    EXIT_HOST_EXCLUDED: "EXIT_HOST_EXCLUDED",
    EXIT_EXCHANGE_TIMEOUT: "EXIT_EXCHANGE_TIMEOUT",
    EXIT_NONFINITE_STATE: "EXIT_NONFINITE_STATE",
    EXIT_SIGINT: "EXIT_SIGINT",
    EXIT_SIGTERM: "EXIT_SIGTERM",
}
