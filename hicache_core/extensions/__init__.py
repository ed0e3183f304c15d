"""Extensions: plugins that wrap the I/O hooks of whatever backend is selected (metrics, tracing).

Each is loaded by name through the ``hicache.extensions`` entry points, so this package imports
none of them eagerly.
"""

__all__: list[str] = []
