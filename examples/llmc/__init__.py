"""llm.c's GPT-2 on custom CUDA kernels through a fulmen operator executor.

model.py is the unchanged reference model, kernels.py the kernels (compiled at run time with NVRTC), executor.py
the "llm.c" executor that maps the model onto them, train.py the eager-vs-fulmen comparison. Importing the
package imports none of them, so nothing here needs a GPU or cuda-python until used.
"""
