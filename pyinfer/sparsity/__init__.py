"""The offline steps that make a model sparse: calibration text (`corpus`), activation profiles (`profiler`),
hot-first neuron order (`reorder`), trained predictors (`train_predictors`), all of them in one command
(`sparsify`), synthetic predictors of a chosen density (`synthetic_predictors`), and ReLU-fication by
distillation (`relufy`)."""
