// Stand-in for the CUDA header of the same name: emu.h provides what the kernels use of it.
#pragma once
