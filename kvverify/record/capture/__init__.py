"""What a recording sees of the live program: torch's dispatcher, the driver calls of every
thread (CUPTI and cuda-python), host threads and their locks, and where in the program each happened."""
