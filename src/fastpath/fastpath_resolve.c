/* preload()'s driver queries in one C call: cuproc.driver.Driver.preload asks cuGetProcAddress for
 * some 480 symbols.  From Python each query is a cffi call through libffi plus the reads of its two
 * out-parameters, about 1.2 us; the driver's own lookup is under 0.1 us (the C floor of
 * benchmarks/bench_driver.py), so the loop is most of preload()'s time.  Here it runs in C, through
 * the lookup pointer the loader took from the library (never a link against libcuda).
 * Compiled into the cffi API-mode module by tools/build_fastpath.py, after the declarations of
 * headers/ (CUresult, the two PFN_cuGetProcAddress typedefs). */

/* Ask for each of ``n`` names, read in turn from ``names`` (``size`` bytes of consecutive
 * NUL-terminated strings), at ``versions[i]`` with ``flags``, through ``lookup``: a
 * PFN_cuGetProcAddress_v12000 when ``v2``, else a PFN_cuGetProcAddress_v11030.  ``pointers[i]``
 * gets the pointer the driver wrote (NULL when none); ``statuses[i]`` the symbol status it reported
 * (v2; CU_GET_PROC_ADDRESS_SUCCESS for v1), or -1 when the call itself did not return CUDA_SUCCESS.
 * Returns the number of names asked: ``n``, or fewer when ``names`` ends before its n-th string
 * (then nothing past it is touched). */
int cuproc_ask_all(void *lookup, int v2, const char *names, size_t size, const int *versions,
                   unsigned long long flags, int n, void **pointers, int *statuses)
{
    const char *at = names, *end = names + size;
    int i;
    for (i = 0; i < n; i++) {
        const char *nul = at < end ? memchr(at, 0, (size_t)(end - at)) : NULL;
        CUresult rc;
        CUdriverProcAddressQueryResult status = CU_GET_PROC_ADDRESS_SUCCESS;
        if (nul == NULL)
            return i;
        pointers[i] = NULL;
        if (v2)
            rc = ((PFN_cuGetProcAddress_v12000)lookup)(at, &pointers[i], versions[i], (cuuint64_t)flags, &status);
        else
            rc = ((PFN_cuGetProcAddress_v11030)lookup)(at, &pointers[i], versions[i], (cuuint64_t)flags);
        statuses[i] = rc == CUDA_SUCCESS ? (int)status : -1;
        at = nul + 1;
    }
    return n;
}
