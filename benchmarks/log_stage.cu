// The pass log's read-back written by the pass itself: at the end of a forward, `stage_log_words` (one block) copies
// the log's device words into pinned host memory (mapped under unified addressing: its host address is valid in a
// kernel) and then sets a host flag word to 1. A host that has synchronised the stream reads the words there without a
// copy of its own (no device-to-host copy launched after the forward, no copy engine). The host clears the flag before
// it launches a pass, so after a synchronise the flag is 1 exactly when a pass it launched since staged; a pass that
// did not stage leaves it 0, and the host then copies as before. Plain-torch reference: `stage_log_ref`
// (benchmarks/log_stage.py).
//
//   words [n]  int32 device: the pass log's buffer
//   host  [n]  int32 pinned host: its copy
//   flag  [1]  int32 pinned host: set to 1 after the words

extern "C" __global__ void __launch_bounds__(1024) stage_log_words(const int4* __restrict__ words, int4* host,
                                                                    int quads, const int* __restrict__ tail_words,
                                                                    int* tail_host, int tail, int* flag) {
  for (int i = threadIdx.x; i < quads; i += blockDim.x) host[i] = words[i];
  if (threadIdx.x < tail) tail_host[threadIdx.x] = tail_words[threadIdx.x];
  __threadfence_system();  // every thread's words before the flag, for a host that polls it (readers that
  __syncthreads();         // synchronise the stream see them all anyway)
  if (threadIdx.x == 0) *flag = 1;
}

