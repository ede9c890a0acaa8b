"""A save in the background: the state staged in host memory, written while training goes on."""
