"""The engine's ``kvledger`` verbs, one module each: ``plan``, ``preflight`` and ``fetch``
(torch-free: the init containers), ``serve`` and ``make-model``. Each defines
``add_arguments`` and ``main``; ``cli.py`` imports only the verb it runs. The operator's
verbs (``run``, ``operator``) are the operator's (``operator/local_run.py``,
``operator/main.py``)."""
