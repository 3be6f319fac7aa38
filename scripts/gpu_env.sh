# Sourced by the GPU-machine scripts: puts NVRTC and cuBLAS (the CUDA toolkit's, or the pip
# wheels' beside PyTorch) on LD_LIBRARY_PATH, where cudarc's run-time loading finds them.
for d in /usr/local/cuda/lib64 $(python3 -c 'import nvidia,os;p=os.path.dirname(nvidia.__path__[0]);print(" ".join(os.path.join(r) for r,_,f in os.walk(p) if any(x.startswith(("libnvrtc","libcublas")) for x in f)))' 2>/dev/null); do
    LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}:$d"
done
export LD_LIBRARY_PATH
