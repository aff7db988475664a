"""The broker patches and readers: kombu's Redis transport with an atomic pop, the broker lease heartbeat,
the consumer's restart guard, what a re-published message may ask of its broker (countdowns, headers), and
reading queue depths without consuming. Each replaces or extends one piece of kombu or Celery, and says which.
"""
