"""Where the frozen weights live: dense or quantized experts, on the device or streamed from host memory."""
