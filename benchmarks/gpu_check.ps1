<#
.SYNOPSIS
  The GPU gate on a Windows CUDA workstation: the same steps as benchmarks/gpu_check.sh, ending
  with one verdict line, "GPU CHECK PASSED" or "GPU CHECK FAILED: <what>".

.DESCRIPTION
  On every visible GPU count (1, and 2 when there are two):
    1. tests/test_cuda.py and every family's tests/test_*_cuda.py
    2. the default `strata-bench run` (chunk auto, CUDA graphs on) as a new user types it
    3. the app's run path (strata_gui.run.run_job, what the Run button drives) without Qt
    4. the process executor on CUDA (tests/test_executor_cuda.py; -NoExecutor skips it)
  Runs in a venv made by scripts/install.py (a CUDA torch; the `test` and `cuda` extras):
    py scripts\install.py --test --cuda --torch-index https://download.pytorch.org/whl/cu128
  The log goes to build\gpu-check.log (or -Log). Keep it as docs/bench/<date>-gpu-check-<kind>.log.

.EXAMPLE
  powershell -ExecutionPolicy Bypass -File benchmarks\gpu_check.ps1
  powershell -ExecutionPolicy Bypass -File benchmarks\gpu_check.ps1 -Model synthetic:qwen3-30b-a3b:n_layers=8
#>
param(
    [string]$Python = "",  # default: .venv\Scripts\python.exe
    [string]$Model = "synthetic:qwen3-30b-a3b:n_layers=16",
    [string]$Log = "",
    [switch]$NoExecutor
)
# Native tools write progress to stderr; "Stop" would turn that into errors in Windows PowerShell 5.1.
$ErrorActionPreference = "Continue"
Set-Location (Split-Path -Parent $PSScriptRoot)
if (-not $Python) { $Python = Join-Path (Get-Location) ".venv\Scripts\python.exe" }
if (-not $Log) { $Log = Join-Path (Get-Location) "build\gpu-check.log" }
New-Item -ItemType Directory -Force -Path (Split-Path -Parent $Log) | Out-Null
$env:PYTHONUNBUFFERED = "1"
$env:HF_HUB_OFFLINE = "1"
$env:PYTHONPATH = (Get-Location).Path
Start-Transcript -Path $Log -Force | Out-Null
$fails = New-Object System.Collections.Generic.List[string]

function Step([string]$name, [string[]]$cmd) {
    Write-Host ""
    Write-Host "## $name"
    Write-Host ""
    Write-Host ("$ " + ($cmd -join " "))
    & $Python @cmd
    $rc = $LASTEXITCODE
    if ($rc -ne 0) { $fails.Add("$name (exit $rc)"); Write-Host "-> FAILED: $name (exit $rc)" }
    else { Write-Host "-> ok: $name" }
}

(Get-Date).ToUniversalTime().ToString("u") | Write-Host
& nvidia-smi -L 2>&1 | Write-Host
& $Python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())"
$commit = (& git rev-parse --short HEAD 2>$null)
if (-not $commit) { $commit = "unknown" }
Write-Host "commit $commit"
$n = [int](& $Python -c "import torch; print(torch.cuda.device_count())" 2>$null)
if ($n -lt 1) {
    Write-Host "GPU CHECK FAILED: no CUDA device visible"
    Stop-Transcript | Out-Null
    exit 1
}
$devLists = @("cuda:0")
if ($n -ge 2) { $devLists += "cuda:0,cuda:1" }

# tests/test_cuda.py and every family's tests/test_*_cuda.py (the executor's apart, below)
$cudaTests = @("tests/test_cuda.py") + @(Get-ChildItem tests -Filter "test_*_cuda.py" | Sort-Object Name |
    Where-Object { $_.Name -ne "test_executor_cuda.py" } | ForEach-Object { "tests/$($_.Name)" })
Step "CUDA tests" (@("-m", "pytest", "-q", "-p", "no:cacheprovider") + $cudaTests)
foreach ($d in $devLists) {
    Step "default strata-bench run on $d" @("-m", "engine.cli.bench", "run", "--model", $Model,
        "--prompt-tokens", "8192,32768", "--arm", "devices=$d", "--peak-tflops", "794")
}
if (-not $NoExecutor) {  # stage processes on CUDA (gloo on Windows)
    Step "process executor on CUDA" @("-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_executor_cuda.py")
}
$appArgs = @("benchmarks/app_run_check.py")
foreach ($d in $devLists) { $appArgs += @("--devices", $d) }
Step "app run path on $($devLists -join ' ')" $appArgs

Write-Host ""
if ($fails.Count -eq 0) {
    Write-Host "GPU CHECK PASSED ($n GPU(s): $($cudaTests -join ' '), default strata-bench run, app run path; commit $commit)"
    Stop-Transcript | Out-Null
    exit 0
}
Write-Host ("GPU CHECK FAILED: " + ($fails -join "; "))
Stop-Transcript | Out-Null
exit 1
