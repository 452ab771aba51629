"""The recipes' data, prepared (`prepare.py`: the command `python data/prepare.py <task>` runs, or `python -m
probdiff_callback.data.prepare <task>`), one purpose per module: where the input files come from (`sources`: the paper's
repository, a local copy, a URL prefix or the Hugging Face hub), the chat rows every task builds and reads
(`chat_rows`), one module per task that turns its files into training and held-out rows (`translation`,
`summarization`, `blog`, `alignbench`), and the removal of held-out leaks and repeats that every task's rows go
through last (`leaks`). `prepare.py` itself keeps the command line and the `prepare(...)` that ties them together.
The samples a recipe trains on until its data is prepared stay in the checkout's `data/samples/`.
"""
