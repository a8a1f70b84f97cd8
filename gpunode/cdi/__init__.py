"""gpunode's CDI spec (nvidia.com/gpu): the document from the node's facts, and the node's file."""
