"""The guardrails ``GuardedTask`` composes, one module each."""
