"""``kvverify probe`` and ``kvverify bench``: what this platform's driver does with each source access
order, and what each order costs."""
