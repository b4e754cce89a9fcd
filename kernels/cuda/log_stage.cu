// The pass log's read-back written by the pass itself. At the end of a forward, `stage_log_words` (one block) copies
// the log's device words into pinned host memory (mapped under unified addressing: its host address is valid in a
// kernel) and then sets a host flag word to 1; a host that has synchronised the stream reads the words there without a
// copy of its own (no device-to-host copy launched after the forward, no copy engine). At the start of every pass,
// `reset_log_words` zeroes the log's per-pass words and the host flag in one launch (in place of the memset), so after
// a synchronise the flag is 1 exactly when the stream's last pass staged: a pass that did not stage (or a staged pass
// the host never read, followed by one that did not stage) leaves it 0, and the host then copies as before. Plain-torch
// references: `stage_log_ref`, `reset_log_ref` (kernels/cuda/log_stage.py).
//
//   words [n]  int32 device: the pass log's buffer (reset: its first n words, those cleared per pass)
//   host  [n]  int32 pinned host: its copy
//   flag  [1]  int32 pinned host: 1 after a pass's words, 0 from the start of a pass

extern "C" __global__ void __launch_bounds__(1024) stage_log_words(const int4* __restrict__ words, int4* host,
                                                                    int quads, const int* __restrict__ tail_words,
                                                                    int* tail_host, int tail, int* flag) {
  for (int i = threadIdx.x; i < quads; i += blockDim.x) host[i] = words[i];
  if (threadIdx.x < tail) tail_host[threadIdx.x] = tail_words[threadIdx.x];
  __threadfence_system();  // every thread's words before the flag, for a host that polls it (readers that
  __syncthreads();         // synchronise the stream see them all anyway)
  if (threadIdx.x == 0) *flag = 1;
}

extern "C" __global__ void __launch_bounds__(1024) reset_log_words(int4* words, int quads, int* tail_words, int tail,
                                                                    int* flag) {
  const int4 zero = make_int4(0, 0, 0, 0);
  for (int i = threadIdx.x; i < quads; i += blockDim.x) words[i] = zero;
  if (threadIdx.x < tail) tail_words[threadIdx.x] = 0;
  if (threadIdx.x == 0) *flag = 0;
}
