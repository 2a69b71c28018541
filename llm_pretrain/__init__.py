"""llm-pretrain: pretraining LLMs with Paddle's fleet hybrid-parallel API."""

import warnings

# `import paddle` warns about a missing ccache (it only matters for compiling C++
# extensions, which we never do); keep it from burying our one-line errors.
warnings.filterwarnings("ignore", message="No ccache found")
