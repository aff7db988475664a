"""What every layer stands on and which imports none of them: the guardrails' clock, the tenant and
correlation context variables, redaction and sealing of what a retained record keeps, fork safety of background
threads, and the test kit's fault points.
"""
