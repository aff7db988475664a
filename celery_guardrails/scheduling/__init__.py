"""Scheduled work: the beat scheduler that dispatches through the run ledger, wall-clock schedules with
stated DST behaviour, the ledger's records, and the watchdog that detects missed runs without beat.
"""
