"""The recipes' data: `prepare.py`, the command that fetches and splits it into `processed/<task>/`, the package of
its pieces (`preparers/`), and `samples/`, the small stand-ins a recipe trains on until the real data is prepared. A
package so that `data.preparers` imports from the checkout however `prepare.py` is run or loaded (the script puts the
checkout on `sys.path`); it is not installed with `probdiff_callback`, which never imports it.
"""
