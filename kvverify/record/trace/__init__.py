"""What a recording's capture becomes: the recorder's log of ops, the memory map that resolves
pointers to allocations over their lifetimes, and the trace written from them."""
