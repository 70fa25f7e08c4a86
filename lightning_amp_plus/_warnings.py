"""The package's warning category: a misconfiguration or a fault the user should act on.

Informational lines (skipped steps, summaries, what a checkpoint changed) go to the ``lightning_amp_plus`` logger
instead. The test suite turns ``AmpPlusWarning`` into an error, so no test passes while the package says something
is wrong.
"""


class AmpPlusWarning(UserWarning):
    """Something is wrong or suspicious in how mixed precision is used (the message says what, and the fix)."""
