"""`fauxmad sim`: the real placement chain (filters, scorers, tie-break, p2c sampling) over a simulated
fleet of any size, with the bus replaced by in-memory calls, to compare strategies where no test machine
reaches (10,000 workers, 100,000 machines) and to check p2c against the balls-into-bins result."""
