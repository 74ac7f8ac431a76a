<#
.SYNOPSIS
  Build dist\strata-gui (PyInstaller, one folder) and prove it: the frozen app's own
  --selftest --screenshot on the offscreen platform. Exits non-zero when either fails.

.DESCRIPTION
  The Windows twin of packaging/build.sh. strata-gui.exe is a windowed app (no console), so
  the self-test is started with Start-Process -Wait and speaks through its log file:
  build\frozen-selftest\selftest.log beside selftest.png.

.EXAMPLE
  powershell -ExecutionPolicy Bypass -File packaging\build.ps1
  powershell -ExecutionPolicy Bypass -File packaging\build.ps1 -TestOnly
  powershell -ExecutionPolicy Bypass -File packaging\build.ps1 -Python C:\envs\strata\Scripts\python.exe
#>
param(
    [switch]$TestOnly,  # only the frozen self-test of an existing dist\strata-gui
    [string]$Python = "",  # default: .venv\Scripts\python.exe (with the `package` extra installed)
    [int]$TimeoutSeconds = 600
)
# Native tools write progress to stderr; "Stop" would turn that into errors in Windows PowerShell 5.1.
$ErrorActionPreference = "Continue"
Set-Location (Split-Path -Parent $PSScriptRoot)
if (-not $Python) { $Python = Join-Path (Get-Location) ".venv\Scripts\python.exe" }
$App = Join-Path (Get-Location) "dist\strata-gui"
$Exe = Join-Path $App "strata-gui.exe"
$Out = Join-Path (Get-Location) "build\frozen-selftest"

function Fail([string]$msg, [int]$code = 1) {
    Write-Host "build.ps1: $msg" -ForegroundColor Red
    exit $code
}

if (-not $TestOnly) {
    & $Python -m PyInstaller --version | Out-Null
    if ($LASTEXITCODE -ne 0) { Fail "no PyInstaller in $Python; install it with: $Python -m pip install -e `".[package]`"" 2 }
    & $Python -c "import torch; print('build.ps1: torch', torch.__version__, 'CUDA', torch.version.cuda)"

    Write-Host "build.ps1: the app with the left-out modules blocked, in this interpreter (seconds)"
    $env:QT_QPA_PLATFORM = "offscreen"
    $env:HF_HUB_OFFLINE = "1"
    & $Python packaging\check_excludes.py
    $rc = $LASTEXITCODE
    Remove-Item Env:HF_HUB_OFFLINE
    if ($rc -ne 0) { Fail "check_excludes.py failed: a left-out module is needed (see above)" }

    $sw = [Diagnostics.Stopwatch]::StartNew()
    & $Python -m PyInstaller --noconfirm --log-level WARN --distpath dist --workpath build\pyinstaller packaging\strata_gui.spec
    if ($LASTEXITCODE -ne 0) { Fail "PyInstaller failed" }
    Write-Host ("build.ps1: build took {0:N0} s" -f $sw.Elapsed.TotalSeconds)
}

if (-not (Test-Path $Exe)) { Fail "$Exe is missing; build first" }
$Bench = Join-Path $App "strata-bench.exe"
if (-not (Test-Path $Bench)) { Fail "$Bench is missing; build first" }
# the console program answers in the shell (the windowed one cannot)
$usage = & $Bench --help 2>&1 | Out-String
if ($LASTEXITCODE -ne 0 -or $usage -notmatch "usage: strata-bench") { Fail "$Bench --help did not print its usage" }
Write-Host "build.ps1: strata-bench.exe --help prints its usage"
$files = Get-ChildItem -Path $App -Recurse -File
$total = ($files | Measure-Object -Property Length -Sum).Sum
Write-Host ("build.ps1: {0} is {1:N0} MiB ({2} files); largest parts (MiB):" -f $App, ($total / 1MB), $files.Count)
Get-ChildItem -Path (Join-Path $App "_internal") | ForEach-Object {
    $size = if ($_.PSIsContainer) { (Get-ChildItem $_.FullName -Recurse -File | Measure-Object -Property Length -Sum).Sum } else { $_.Length }
    [pscustomobject]@{ MiB = [math]::Round($size / 1MB); Name = $_.Name }
} | Sort-Object MiB -Descending | Select-Object -First 8 | Format-Table -AutoSize | Out-String | Write-Host

if (Test-Path $Out) { Remove-Item -Recurse -Force $Out }
New-Item -ItemType Directory -Force -Path $Out | Out-Null
$shot = Join-Path $Out "selftest.png"
$log = Join-Path $Out "selftest.log"
$env:QT_QPA_PLATFORM = "offscreen"
$sw = [Diagnostics.Stopwatch]::StartNew()
$proc = Start-Process -FilePath $Exe -ArgumentList @("--selftest", "--screenshot", "`"$shot`"") -PassThru
$null = $proc.Handle  # keeps the exit code readable after the process ends
if (-not $proc.WaitForExit($TimeoutSeconds * 1000)) {
    $proc.Kill()
    Fail "the frozen self-test did not finish within $TimeoutSeconds s"
}
$rc = $proc.ExitCode
Write-Host ("build.ps1: frozen self-test exit code {0} after {1:N0} s; log:" -f $rc, $sw.Elapsed.TotalSeconds)
if (Test-Path $log) { Get-Content $log | ForEach-Object { Write-Host "  $_" } } else { Write-Host "  (no $log)" }
$passed = (Test-Path $log) -and (Select-String -Path $log -Pattern "selftest: PASSED" -Quiet)
if ($rc -ne 0 -or -not $passed -or -not (Test-Path $shot)) { Fail "FROZEN SELF-TEST FAILED" }
Write-Host "build.ps1: frozen self-test passed; screenshot $shot"
exit 0
