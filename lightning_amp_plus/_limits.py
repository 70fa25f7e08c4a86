"""Numeric limits shared by the torch-free readers (the plot command) and the argument checks."""

#: float32's largest finite value and smallest normal value: the range a device-side scale can hold
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 2.0**-126
#: the device-side growth and hysteresis trackers are int32
INT32_MAX = 2**31 - 1
