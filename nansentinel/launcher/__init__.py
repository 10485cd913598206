"""The launcher side: what runs in torchrun's agent process, not in a training rank.

- :mod:`~nansentinel.launcher.run`: ``nansentinel run`` -- its options, the torchrun command
  line, the run directory, and the main function.
- :mod:`~nansentinel.launcher.agent`: runs torchrun's elastic agent in this process and turns
  how it ended into one exit code and a per-rank summary.
- :mod:`~nansentinel.launcher.rendezvous_guard`: keeps an excluded host out of the next
  rendezvous round (a wrapper around torchrun's rendezvous handler).
- :mod:`~nansentinel.launcher.on_exclude`: the ``--on-exclude`` command, run without a shell.
- :mod:`~nansentinel.launcher.excluded_command`: ``nansentinel excluded`` (list and clear).
- :mod:`~nansentinel.launcher.console`: the launcher's one-line messages.

Nothing here imports the worker side (sentinel, exchange, checks, torch's training code); the
two sides share only their contracts: config (the ``NANSENTINEL_*`` variables), exclusion
(the exclusion file), verdicts (the files a dying rank leaves) and exitcodes.
"""
