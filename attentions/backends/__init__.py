"""The built-in backends, one file each (the registry imports the modules named in ``BUILTINS``).

A backend is a subclass of ``attentions.Attention`` registered under its name; ../../README.md's
"Add a backend" and docs/backends.md say what a file here holds.
"""
