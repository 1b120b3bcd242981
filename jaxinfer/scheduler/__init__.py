"""Host-side scheduling state: pages and sequences. Plain Python and numpy; imports no jax."""
