// Conditional (IF) nodes in a CUDA graph under stream capture, for a torch without its own
// (`CUDAGraph.begin_capture_to_if_node`, absent before torch 2.12): built as a shared library (host code and
// one kernel), called through ctypes by tierstore/runtime/replay_if.py.
//
// tierstore_begin_if(parent, predicate, body_stream): on `parent`, a stream under capture, a kernel that sets a
// new conditional handle from the device bool `*predicate` when the graph runs, then an IF node after it; the
// parent's capture continues after the IF node, and `body_stream` (not capturing) starts capturing into the
// node's body graph. tierstore_end_if(body_stream) ends that capture. tierstore_new_stream(&stream): a stream of
// the current device for the bodies, made before any capture (a stream from torch's pool may be one that joined
// the capture, and a capturing stream cannot begin another). tierstore_load_if(): loads the kernel's module
// (lazy loading would otherwise do it at the first launch, inside a capture). Each returns 0 or the cudaError_t.
// The caller routes the body's allocations to the graph's memory pool (the runtime does it through torch).

#include <cuda_runtime.h>

namespace {

__global__ void set_if(cudaGraphConditionalHandle handle, const bool* predicate) {
  cudaGraphSetConditional(handle, *predicate ? 1u : 0u);
}

cudaError_t capture_info(cudaStream_t stream, cudaGraph_t* graph, const cudaGraphNode_t** deps,
                         const cudaGraphEdgeData** edges, size_t* count) {
  cudaStreamCaptureStatus status;
#if CUDART_VERSION >= 13000
  cudaError_t error = cudaStreamGetCaptureInfo(stream, &status, nullptr, graph, deps, edges, count);
#else
  cudaError_t error = cudaStreamGetCaptureInfo_v3(stream, &status, nullptr, graph, deps, edges, count);
#endif
  if (error == cudaSuccess && status != cudaStreamCaptureStatusActive) return cudaErrorStreamCaptureInvalidated;
  return error;
}

}  // namespace

extern "C" int tierstore_begin_if(void* parent_stream, const void* predicate, void* body_stream) {
  cudaStream_t parent = static_cast<cudaStream_t>(parent_stream);
  cudaGraph_t graph;
  const cudaGraphNode_t* deps;
  const cudaGraphEdgeData* edges;
  size_t count;
  cudaError_t error = capture_info(parent, &graph, &deps, &edges, &count);
  if (error != cudaSuccess) return error;
  cudaGraphConditionalHandle handle;
  error = cudaGraphConditionalHandleCreate(&handle, graph, 0, 0);
  if (error != cudaSuccess) return error;
  set_if<<<1, 1, 0, parent>>>(handle, static_cast<const bool*>(predicate));
  error = cudaGetLastError();
  if (error != cudaSuccess) return error;
  error = capture_info(parent, &graph, &deps, &edges, &count);  // now after the kernel
  if (error != cudaSuccess) return error;
  cudaGraphNodeParams params = {};
  params.type = cudaGraphNodeTypeConditional;
  params.conditional.handle = handle;
  params.conditional.type = cudaGraphCondTypeIf;
  params.conditional.size = 1;
  cudaGraphNode_t node;
#if CUDART_VERSION >= 13000
  error = cudaGraphAddNode(&node, graph, deps, edges, count, &params);
  if (error != cudaSuccess) return error;
  error = cudaStreamUpdateCaptureDependencies(parent, &node, nullptr, 1, cudaStreamSetCaptureDependencies);
#else
  error = cudaGraphAddNode_v2(&node, graph, deps, edges, count, &params);
  if (error != cudaSuccess) return error;
  error = cudaStreamUpdateCaptureDependencies_v2(parent, &node, nullptr, 1, cudaStreamSetCaptureDependencies);
#endif
  if (error != cudaSuccess) return error;
  return cudaStreamBeginCaptureToGraph(static_cast<cudaStream_t>(body_stream), params.conditional.phGraph_out[0],
                                       nullptr, nullptr, 0, cudaStreamCaptureModeThreadLocal);
}

extern "C" int tierstore_end_if(void* body_stream) {
  cudaGraph_t body;
  return cudaStreamEndCapture(static_cast<cudaStream_t>(body_stream), &body);
}

extern "C" int tierstore_new_stream(void** stream) {
  return cudaStreamCreateWithFlags(reinterpret_cast<cudaStream_t*>(stream), cudaStreamNonBlocking);
}

extern "C" int tierstore_load_if() {
  cudaFuncAttributes attributes;
  return cudaFuncGetAttributes(&attributes, set_if);
}
