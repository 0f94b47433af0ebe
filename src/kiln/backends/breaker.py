"""The circuit breaker, where backends have always imported it from: see :mod:`kiln.circuit`."""

from kiln.circuit import CircuitBreaker, Permit, State

__all__ = ["CircuitBreaker", "Permit", "State"]
