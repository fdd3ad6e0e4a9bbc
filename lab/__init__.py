"""What measures fauxmad, outside the product: the benchmarks behind `fauxmad bench` (`lab.bench`) and the
placement simulator behind `fauxmad sim` (`lab.sim`). The CLI imports them only inside those commands.
"""
