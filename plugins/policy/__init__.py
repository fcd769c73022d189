"""Scheduling policies: first come first served, priority, virtual token counter fair
sharing and earliest deadline first."""
